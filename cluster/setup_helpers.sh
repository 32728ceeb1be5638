# Sourced by .ci/python312 and cluster/try_setup_on_ubuntu.sh, each run from the repository root, so that both read
# cluster/h200.yaml's set-up and copy the checkout the same way.

# cluster/h200.yaml's setup_commands, one per line: each is a one-line item of that YAML list, as ray up runs it.
h200_setup_commands() {
    awk '/^setup_commands:/ {inside = 1; next} /^[^ #]/ {inside = 0} inside && /^  - / {sub(/^  - /, ""); print}' cluster/h200.yaml
}

# This checkout's tracked files and the untracked ones git does not ignore, copied into the directory $1.
copy_checkout() {
    git ls-files -z --cached --others --exclude-standard | tar --null --files-from=- --ignore-failed-read -cf - | tar -xf - -C "$1"
}
