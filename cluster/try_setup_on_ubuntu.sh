#!/usr/bin/env bash
# Runs cluster/h200.yaml's setup commands, all of them, apt line included, on a fresh Ubuntu 24.04: the release the
# YAML's image (AWS's Deep Learning base AMI for Ubuntu 24.04) is built on, made here by debootstrap in a directory and
# entered with chroot, so that a change to the set-up is tried without launching a node. Each command runs as `ray up`
# runs it on a node: as the SSH user (ubuntu, password-less sudo), in an interactive login shell that reads ~/.bashrc,
# with this checkout (tracked files and the untracked ones git does not ignore) at ~/flowrl. Then it checks what the
# set-up must leave: a Python 3.12 virtual environment at ~/flowrl-venv that ~/.bashrc activates, a project that
# imports lerobot's pi0, and the EGL and GL libraries MuJoCo renders through.
# What it cannot show: the AMI's packages beyond a minimal Ubuntu with the cloud image's apt sources, and the NVIDIA
# driver (rendering on a GPU).
#
#   sudo bash cluster/try_setup_on_ubuntu.sh [--keyring FILE] [--mirror URL] [--ca-file FILE]... [--keep] [ROOT]
#
# Needs root, debootstrap, Ubuntu's archive keyring (Ubuntu's ubuntu-keyring package; --keyring names the file where
# the host is not Ubuntu) and network to the Ubuntu archive and the Python package index. ROOT (default: a new
# temporary directory) must not exist yet; it is removed at the end unless --keep. Behind a proxy that signs TLS with a
# certificate authority of its own, --ca-file adds that authority to the Ubuntu's certificates and has pip use them.
set -euo pipefail
usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
refuse() { echo "error: $1" >&2; exit 2; }

keyring=/usr/share/keyrings/ubuntu-archive-keyring.gpg
mirror=http://archive.ubuntu.com/ubuntu
keep=false
root=""
ca_files=()
while [ $# -gt 0 ]; do
    case "$1" in
        --keyring|--mirror|--ca-file) [ $# -ge 2 ] || refuse "$1 needs a value (see --help)" ;;&
        --keyring) keyring=$(realpath -m "$2"); shift 2 ;;
        --mirror) mirror=$2; shift 2 ;;
        --ca-file) [ -f "$2" ] && [ -r "$2" ] || refuse "--ca-file $2: no such readable file"
                   ca_files+=("$(realpath "$2")"); shift 2 ;;
        --keep) keep=true; shift ;;
        -h|--help) usage; exit 0 ;;
        -*) refuse "unknown option $1 (see --help)" ;;
        *) [ -z "$root" ] || refuse "one ROOT directory only, got $root and $1"
           root=$(realpath -m "$1"); shift ;;
    esac
done
[ -z "$root" ] || [ ! -e "$root" ] || refuse "$root exists: name a new directory, so that nothing there is overwritten"
[ "$(id -u)" -eq 0 ] || refuse "needs root (debootstrap and chroot): run it with sudo"
command -v debootstrap > /dev/null || refuse "needs debootstrap (apt-get install debootstrap)"
[ -r "$keyring" ] || refuse "no Ubuntu archive keyring at $keyring (install ubuntu-keyring, or name the file with --keyring)"
if [ -z "$root" ]; then
    root=$(mktemp -d "${TMPDIR:-/tmp}/ubuntu-noble.XXXXXX")
    rmdir "$root"
fi
cd "$(dirname "$0")/.."
source cluster/setup_helpers.sh

mounted=()
cleanup() {
    local index
    for ((index = ${#mounted[@]} - 1; index >= 0; index--)); do umount -l "${mounted[index]}" || true; done
    if $keep; then echo "kept $root"; else rm -rf --one-file-system "$root"; fi
}
trap cleanup EXIT

start=$SECONDS
echo "Ubuntu 24.04 (noble) from $mirror into $root"
# An older debootstrap has no script named noble; every Ubuntu release since 7.10 is made by its gutsy script.
script=/usr/share/debootstrap/scripts/noble
[ -e "$script" ] || script=/usr/share/debootstrap/scripts/gutsy
debootstrap --variant=minbase --components=main,universe --keyring="$keyring" noble "$root" "$mirror" "$script" > "$root.debootstrap.log" 2>&1 \
    || { echo "error: debootstrap failed; its log: $root.debootstrap.log" >&2; exit 1; }
rm -f "$root.debootstrap.log"
# The cloud image's apt sources: the release, its updates and security pockets, every component.
rm -f "$root/etc/apt/sources.list"
cat > "$root/etc/apt/sources.list.d/ubuntu.sources" <<EOF
Types: deb
URIs: $mirror
Suites: noble noble-updates noble-security
Components: main restricted universe multiverse
Signed-By: /usr/share/keyrings/ubuntu-archive-keyring.gpg
EOF
cp /etc/resolv.conf "$root/etc/resolv.conf"
printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "$(hostname)" > "$root/etc/hosts"  # sudo looks its host name up
for target in proc sys dev dev/pts; do
    case "$target" in
        proc) mount -t proc proc "$root/proc" ;;
        sys) mount -t sysfs sysfs "$root/sys" ;;
        *) mount --bind "/$target" "$root/$target" ;;
    esac
    mounted+=("$root/$target")
done
in_root() { chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive "$@"; }
# What the AMI has before the set-up: sudo, certificates for pip, and the SSH user with password-less sudo.
prepare_log="$root.prepare.log"
{
    in_root apt-get -q update
    in_root apt-get -q install -y --no-install-recommends sudo ca-certificates
    if [ "${#ca_files[@]}" -gt 0 ]; then
        for ca_file in "${ca_files[@]}"; do cp "$ca_file" "$root/usr/local/share/ca-certificates/$(basename "${ca_file%.*}").crt"; done
        in_root update-ca-certificates
        printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$root/etc/pip.conf"
    fi
} > "$prepare_log" 2>&1 || { tail -n 20 "$prepare_log" >&2; echo "error: could not install sudo or the certificates in the Ubuntu root" >&2; exit 1; }
in_root useradd --create-home --shell /bin/bash ubuntu
echo "ubuntu ALL=(ALL) NOPASSWD:ALL" > "$root/etc/sudoers.d/90-ubuntu"
mkdir "$root/home/ubuntu/flowrl"
copy_checkout "$root/home/ubuntu/flowrl"
in_root chown -R ubuntu:ubuntu /home/ubuntu/flowrl
rm -f "$prepare_log"
echo "a minimal Ubuntu with the SSH user in $((SECONDS - start)) s"

as_ubuntu() { in_root sudo -u ubuntu -H bash --login -i -c "$1" 2> >(grep -v -e "cannot set terminal process group" -e "no job control in this shell" >&2); }
mapfile -t setup < <(h200_setup_commands)
[ "${#setup[@]}" -gt 0 ] || { echo "error: cluster/h200.yaml has no setup_commands" >&2; exit 1; }
for command in "${setup[@]}"; do
    step=$SECONDS
    echo "cluster/h200.yaml's setup: $command"
    as_ubuntu "$command" > "$root/setup.log" 2>&1 \
        || { tail -n 20 "$root/setup.log" >&2; echo "error: cluster/h200.yaml's setup command failed on Ubuntu 24.04: $command" >&2; exit 1; }
    echo "  done in $((SECONDS - step)) s"
done

fail() { echo "error: cluster/h200.yaml's setup commands $1" >&2; exit 1; }
as_ubuntu 'python -c "import sys; assert sys.prefix.endswith(\"/flowrl-venv\") and sys.version_info[:2] == (3, 12)"' \
    || fail "left no Python 3.12 virtual environment at ~/flowrl-venv that a login shell activates"
as_ubuntu 'cd ~ && python -c "import lerobot.policies.pi0, learner.main"' || fail "installed no project that imports lerobot's pi0"
libraries=$(in_root ldconfig -p)
for library in libEGL.so.1 libGL.so.1; do
    grep -q "^[[:space:]]$library " <<< "$libraries" || fail "installed no $library (MuJoCo renders through it)"
done
# One frame through EGL, as the cluster's nodes render (MUJOCO_GL=egl): here by Mesa's software renderer, which
# libegl1 brings in; on a node by the NVIDIA driver's.
cat > "$root/tmp/render_one_frame.py" <<'EOF'
import mujoco

model = mujoco.MjModel.from_xml_string('<mujoco><worldbody><light pos="0 0 1"/><geom size="0.1"/></worldbody></mujoco>')
data = mujoco.MjData(model)
mujoco.mj_forward(model, data)
with mujoco.Renderer(model, 64, 64) as renderer:
    renderer.update_scene(data)
    assert renderer.render().max() > 0, "a blank frame"
EOF
as_ubuntu 'MUJOCO_GL=egl python /tmp/render_one_frame.py' || fail "left MuJoCo unable to render through EGL (MUJOCO_GL=egl)"
as_ubuntu 'python -c "import sys, torch, lerobot; print(\"Python\", sys.version.split()[0], \"torch\", torch.__version__, \"lerobot\", lerobot.__version__)"'
echo "cluster/h200.yaml's setup passed on Ubuntu 24.04 in $((SECONDS - start)) s"
