"""What several test modules share and is not a fixture: tiny VLAs and their checks, run comparisons, fault injection.
Test modules import from here (and from tests.conftest), never from one another."""
