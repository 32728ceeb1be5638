"""Screenshot the Ray dashboard's actors page during a short local run, with headless Chromium.

    apt-get install -y chromium        # Debian's; any Chromium or Chrome binary works (--chromium PATH)
    python cluster/dashboard_screenshot.py --out docs/ray_dashboard_actors.png

It starts a short `python -m learner.main` run (tiny sizes, random init: the picture is about the
actors, not the policy), waits until the dashboard lists the learner and every rollout actor as
ALIVE, opens the actors page in Chromium, and saves a PNG. The dashboard's API needs Ray's token
(~/.ray/auth_token): the script hands it to the browser as the `ray-authentication-token` cookie
(what the dashboard's own login form sets), through the DevTools protocol over a pipe, so no extra
Python package is needed. Kept out of CI: it needs Chromium and a minute of wall time.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKEN_FILE = Path.home() / ".ray" / "auth_token"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars"]  # fmt: skip
TINY_RUN = ["--allow-random-init", "--iterations", "1000", "--set", "actors.decisions_per_rollout=8", "--set", "env.max_episode_steps=40",
            "--set", "algorithm.minibatch_size=16", "--set", "algorithm.update_epochs=2", "--set", "eval_every=0",
            "--set", "eval_episodes=4", "--set", "checkpoint_every=1000"]  # fmt: skip


class DevTools:
    """The Chrome DevTools protocol over --remote-debugging-pipe: JSON messages separated by NUL bytes on fds 3 and 4."""

    def __init__(self, chromium: str, user_data_dir: str, width: int, height: int):
        to_browser_read, self.to_browser = os.pipe()
        self.from_browser, from_browser_write = os.pipe()

        def wire_fds() -> None:  # in the child: the browser reads commands on fd 3 and writes replies on fd 4
            os.dup2(to_browser_read, 3)
            os.dup2(from_browser_write, 4)

        command = [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={user_data_dir}", f"--window-size={width},{height}",
                   "--remote-debugging-pipe", "about:blank"]  # fmt: skip
        self.process = subprocess.Popen(command, preexec_fn=wire_fds, pass_fds=(3, 4), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_read)
        os.close(from_browser_write)
        self.buffer = b""
        self.next_id = 0

    def call(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        while True:
            while b"\0" not in self.buffer:
                chunk = os.read(self.from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"Chromium closed the DevTools pipe while waiting for {method}")
                self.buffer += chunk
            raw, self.buffer = self.buffer.split(b"\0", 1)
            reply = json.loads(raw)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"DevTools {method}: {reply['error']}")
                return reply["result"]

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def dashboard_url(log: Path, timeout: float) -> str:
    """The dashboard address Ray prints when the run starts it (8265 unless that port is taken)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(r"View the dashboard at \S*?(http://127\.0\.0\.1:\d+)", re.sub(r"\x1b\[[0-9;]*m", "", log.read_text()))
        if found:
            return found.group(1)
        time.sleep(1)
    raise TimeoutError(f"no dashboard address in {log} after {timeout:.0f}s")


def wait_for_actors(url: str, token: str, num_actors: int, timeout: float) -> list[dict]:
    """Poll the state API (with the token) until the learner and every rollout actor are ALIVE."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        request = urllib.request.Request(f"{url}/api/v0/actors?limit=1000", headers={"Authorization": f"Bearer {token}"})
        try:
            actors = json.loads(urllib.request.urlopen(request, timeout=10).read())["data"]["result"]["result"]
        except OSError:
            actors = []
        alive = [a for a in actors if a["state"] == "ALIVE" and a["class_name"] in ("LearnerActor", "RolloutActor")]
        if len(alive) == num_actors + 1:
            return alive
        time.sleep(2)
    raise TimeoutError(f"the learner and {num_actors} rollout actors were not all ALIVE on {url} after {timeout:.0f}s")


def screenshot(chromium: str, page: str, token: str, out: Path, width: int, height: int, settle: float) -> None:
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        browser = DevTools(chromium, profile, width, height)
        try:
            target = next(t for t in browser.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
            session = browser.call("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True})["sessionId"]
            browser.call("Network.enable", session=session)
            host = re.match(r"http://([^:/]+)", page).group(1)
            browser.call("Network.setCookie", {"name": "ray-authentication-token", "value": token, "domain": host, "path": "/",
                                               "httpOnly": True}, session=session)  # fmt: skip
            browser.call("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
                         session=session)  # fmt: skip
            browser.call("Page.navigate", {"url": page}, session=session)
            time.sleep(settle)  # the page loads, then polls the state API; give it a few refreshes
            data = browser.call("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
        finally:
            browser.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(base64.b64decode(data))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "ray_dashboard_actors.png")
    parser.add_argument("--num-actors", type=int, default=4)
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome"))
    parser.add_argument("--size", default="1600x1000", help="browser viewport WIDTHxHEIGHT")
    parser.add_argument("--settle", type=float, default=12.0, help="seconds to let the page load before the screenshot")
    args = parser.parse_args(argv)
    if not args.chromium:
        print("chromium not found: apt-get install -y chromium (or pass --chromium PATH)", file=sys.stderr)
        return 2
    width, height = (int(v) for v in args.size.split("x"))

    with tempfile.TemporaryDirectory(prefix="flowrl-dashboard-") as tmp:
        log = Path(tmp) / "run.log"
        env = {**os.environ, "WANDB_MODE": "disabled", "RAY_DEDUP_LOGS": "0"}
        command = [sys.executable, "-m", "learner.main", "--num-actors", str(args.num_actors), "--run-dir", f"{tmp}/run", *TINY_RUN]
        with log.open("w") as log_file:
            run = subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            url = dashboard_url(log, timeout=120)
            token = TOKEN_FILE.read_text().strip()
            actors = wait_for_actors(url, token, args.num_actors, timeout=240)
            print(f"{url}: {len(actors)} actors ALIVE: {sorted(a['class_name'] for a in actors)}", flush=True)
            screenshot(args.chromium, f"{url}/#/actors", token, args.out, width, height, args.settle)
        finally:
            run.send_signal(signal.SIGINT)  # the driver saves a checkpoint (in tmp) and shuts its Ray down
            try:
                run.wait(timeout=60)
            except subprocess.TimeoutExpired:
                run.kill()
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
