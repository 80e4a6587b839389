# shellcheck shell=bash
# lib-cuda.sh: the CUDA 11.8 headers + libcuda cache shared by
# scripts/cuda-check and scripts/gpu-check. Source it, define
#   say MSG...               progress line
#   die MSG...               fatal error (exits non-zero)
#   cuda_unavailable REASON  the Debian archive cannot be reached (cuda-check
#                            skips loudly and exits 0; gpu-check fails)
# then call cuda_setup. It downloads Debian's non-free nvidia-cuda-dev (CUDA
# headers) and libcuda1 (the driver library, linked against, never run here)
# with a private apt state, so the system's apt configuration is not touched,
# unpacks them into a cache, and exports CGO_ENABLED, CGO_CFLAGS and
# CGO_LDFLAGS for a -tags cuda build against them.
#
# Cache: $KVACTORS_CUDA_CACHE, else ${XDG_CACHE_HOME:-$HOME/.cache}/kvactors-cuda;
# reused once unpacked (~50 MB; the ~770 MB download is deleted after).
# Mirror: $KVACTORS_DEBIAN_MIRROR, else the Debian archive configured in
# /etc/apt/sources.list*, else http://deb.debian.org/debian.
#
# After cuda_setup: $cache, $root (unpacked packages; headers in
# $root/usr/include) and $libdir (holds a libcuda.so to link with) are set,
# and the cache's lock (fd 9) is held until the calling script exits: two
# scripts at once would unpack into each other.

cache=${KVACTORS_CUDA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvactors-cuda}
root=$cache/root
stamp=$root/.kvactors-complete
libdir=

# debian_mirror prints the first Debian archive URI configured for apt
# (deb822 .sources or one-line .list), skipping the security archive.
debian_mirror() {
	local f uri
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
		[[ -r $f ]] || continue
		if [[ $f == *.sources ]]; then
			uri=$(awk 'tolower($1) == "uris:" { for (i = 2; i <= NF; i++) print $i }' "$f")
		else
			uri=$(awk '$1 == "deb" { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; break } }' "$f")
		fi
		uri=$(printf '%s\n' "$uri" | grep -E '/debian/?$' | grep -v security | head -n1 || true)
		if [[ -n $uri ]]; then
			printf '%s\n' "${uri%/}"
			return
		fi
	done
	printf '%s\n' http://deb.debian.org/debian
}

# cuda_fetch downloads and unpacks the two packages into $root.
cuda_fetch() {
	if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
		cuda_unavailable "apt-get/dpkg-deb not found: not a Debian-based machine"
	fi
	[[ -r /etc/os-release ]] || cuda_unavailable "no /etc/os-release"
	local codename id
	# shellcheck source=/dev/null
	codename=$(. /etc/os-release && printf '%s' "${VERSION_CODENAME:-}")
	# shellcheck source=/dev/null
	id=$(. /etc/os-release && printf '%s' "${ID:-}")
	[[ $id == debian && -n $codename ]] || cuda_unavailable "not Debian (ID=$id VERSION_CODENAME=$codename)"

	local mirror components apt sl keyring
	mirror=${KVACTORS_DEBIAN_MIRROR:-$(debian_mirror)}
	components="main contrib non-free"
	case $codename in buster | bullseye) ;; *) components+=" non-free-firmware" ;; esac
	keyring=/usr/share/keyrings/debian-archive-keyring.gpg
	apt=$cache/apt
	sl=$apt/sources.list
	mkdir -p "$apt/lists/partial" "$apt/cache/archives/partial" "$cache/debs"
	if [[ -r $keyring ]]; then
		printf 'deb [signed-by=%s] %s %s %s\n' "$keyring" "$mirror" "$codename" "$components" >"$sl"
	else
		printf 'deb %s %s %s\n' "$mirror" "$codename" "$components" >"$sl"
	fi
	# Private sources, lists and cache: the system's apt state stays as is.
	local opts=(
		-o "Dir::Etc::SourceList=$sl" -o Dir::Etc::SourceParts=/dev/null
		-o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache"
		-o "APT::Sandbox::User=$(id -un)" -o Acquire::Retries=2 -o Acquire::http::Timeout=30
		-o APT::Update::Error-Mode=any
	)
	say "apt-get update from $mirror $codename ($components)"
	apt-get "${opts[@]}" -qq update || cuda_unavailable "apt-get update from $mirror failed"
	apt-cache "${opts[@]}" show nvidia-cuda-dev libcuda1 >/dev/null 2>&1 ||
		cuda_unavailable "nvidia-cuda-dev or libcuda1 not in $mirror $codename"
	say "downloading nvidia-cuda-dev and libcuda1 (~770 MB)"
	(cd "$cache/debs" && apt-get "${opts[@]}" -q download nvidia-cuda-dev libcuda1) ||
		cuda_unavailable "apt-get download from $mirror failed"

	local tmp=$cache/root.tmp.$$ deb
	rm -rf "$tmp"
	mkdir -p "$tmp"
	for deb in "$cache"/debs/*.deb; do
		case $(basename "$deb") in
		nvidia-cuda-dev_*)
			# Only the headers: the package is 2.8 GB unpacked, mostly
			# static libraries this build never reads.
			dpkg-deb --fsys-tarfile "$deb" | tar -x -C "$tmp" ./usr/include
			;;
		*) dpkg -x "$deb" "$tmp" ;;
		esac
		say "unpacked $(basename "$deb")"
	done
	rm -rf "$root"
	mv "$tmp" "$root"
	(cd "$cache/debs" && ls -- *.deb) >"$stamp"
	rm -f "$cache"/debs/*.deb
}

# cuda_setup makes sure the cache is unpacked (locking it), finds the
# library to link with and exports the cgo environment.
cuda_setup() {
	mkdir -p "$cache"
	if command -v flock >/dev/null; then
		# Two checks at once would unpack into each other.
		exec 9>"$cache/.lock"
		flock 9
	fi
	if [[ -f $stamp && -f $root/usr/include/cuda.h ]]; then
		say "reusing $root ($(tr '\n' ' ' <"$stamp"))"
	else
		cuda_fetch
	fi
	[[ -f $root/usr/include/cuda.h ]] || die "no cuda.h under $root/usr/include"

	# The directory to link from: one with libcuda.so that resolves, else a
	# private one with a libcuda.so link to libcuda.so.1.
	local so so1
	libdir=
	while IFS= read -r so; do
		if [[ -e $so ]]; then
			libdir=$(dirname "$so")
			break
		fi
	done < <(find "$root" -name libcuda.so)
	if [[ -z $libdir ]]; then
		so1=$(find "$root" -name libcuda.so.1 | while IFS= read -r f; do [[ -e $f ]] && printf '%s\n' "$f"; done | head -n1)
		[[ -n $so1 ]] || die "no libcuda.so or libcuda.so.1 under $root"
		libdir=$cache/lib
		mkdir -p "$libdir"
		ln -sfn "$(readlink -f "$so1")" "$libdir/libcuda.so"
	fi
	say "headers: $root/usr/include; libcuda: $libdir"

	command -v "$(go env CC)" >/dev/null || die "no C compiler ($(go env CC)): cgo cannot build"
	export CGO_ENABLED=1
	export CGO_CFLAGS="-O2 -g -I$root/usr/include"
	export CGO_LDFLAGS="-L$libdir"
}

# cuda_fake_driver builds backend/cuda/testdata/fakecuda.c (run from the
# repository root) into $cache/fake/libcuda.so.1 and prints that directory:
# put it in LD_LIBRARY_PATH to run cuda-tagged binaries without a GPU.
cuda_fake_driver() {
	local fake=$cache/fake
	mkdir -p "$fake" || return 1
	"$(go env CC)" -shared -fPIC -O2 -Wall -Wextra -Werror -I"$root/usr/include" \
		-o "$fake/libcuda.so.1" backend/cuda/testdata/fakecuda.c || return 1
	printf '%s\n' "$fake"
}
