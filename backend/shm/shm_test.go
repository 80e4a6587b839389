package shm_test

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/backend/backendtest"
	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/messages"
)

// harness runs the conformance suite on real shm objects in a temp dir: the
// engine side writes and reads through its own Segment mapping, which is
// exactly how an engine shares memory with kvactors. New and Segments of one
// test share that test's dir, whichever is called first.
func harness() backendtest.Harness {
	var mu sync.Mutex
	dirs := map[*testing.T]string{}
	dirOf := func(t *testing.T) string {
		mu.Lock()
		defer mu.Unlock()
		if dirs[t] == "" {
			dirs[t] = t.TempDir()
		}
		return dirs[t]
	}
	return backendtest.Harness{
		New: func(t *testing.T) backend.Backend { return newBackend(t, dirOf(t)) },
		Segments: func(t *testing.T, sizes []int64) backendtest.Segments {
			var segs []*shm.Segment
			var specs []messages.Segment
			for i, size := range sizes {
				s := create(t, dirOf(t), fmt.Sprintf("seg-%d", i), size)
				segs = append(segs, s)
				specs = append(specs, s.Spec())
			}
			return backendtest.Segments{
				Specs: specs,
				Write: func(seg int, off int64, p []byte) { copy(segs[seg].Bytes()[off:], p) },
				Read: func(seg int, off, n int64) []byte {
					return append([]byte(nil), segs[seg].Bytes()[off:off+n]...)
				},
			}
		},
	}
}

func TestConformance(t *testing.T) {
	backendtest.Run(t, harness())
}

func newBackend(t testing.TB, dir string) *shm.Backend {
	t.Helper()
	b, err := shm.New(shm.Config{Dir: dir})
	require.NoError(t, err)
	return b
}

func create(t testing.TB, dir, name string, size int64) *shm.Segment {
	t.Helper()
	s, err := shm.Create(dir, name, size)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, s.Remove()) })
	return s
}

func TestConfig(t *testing.T) {
	require.Equal(t, "/dev/shm", shm.DefaultConfig().Dir)
	require.NoError(t, shm.DefaultConfig().Validate())
	require.ErrorContains(t, shm.Config{}.Validate(), "empty")
	require.ErrorContains(t, shm.Config{Dir: "rel/dir"}.Validate(), "absolute")

	_, err := shm.New(shm.Config{Dir: "rel"})
	require.ErrorContains(t, err, "absolute")
	dir := t.TempDir()
	_, err = shm.New(shm.Config{Dir: filepath.Join(dir, "missing")})
	require.ErrorIs(t, err, fs.ErrNotExist)
	file := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(file, []byte("x"), 0o600))
	_, err = shm.New(shm.Config{Dir: file})
	require.ErrorIs(t, err, unix.ENOTDIR)

	b := newBackend(t, dir)
	require.Equal(t, "shm", b.Name())
	require.Equal(t, dir, b.Dir())
}

// TestAttachRefuses covers PROTOCOL.md EngineSpec "segments": NAME is a plain
// file name, no "/", no "..", no links followed; the object must be a
// non-empty regular file. The bad segment is index 1 behind a good one, so
// the error must name the index and Attach must undo segment 0.
func TestAttachRefuses(t *testing.T) {
	dir := t.TempDir()
	outside := t.TempDir()
	good := create(t, dir, "good", 4096)
	require.NoError(t, os.WriteFile(filepath.Join(outside, "secret"), []byte("secret"), 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "regular"), []byte("data"), 0o600))
	require.NoError(t, os.Symlink("regular", filepath.Join(dir, "link-in")))
	require.NoError(t, os.Symlink(filepath.Join(outside, "secret"), filepath.Join(dir, "link-out")))
	require.NoError(t, os.Symlink("nowhere", filepath.Join(dir, "link-dangling")))
	require.NoError(t, os.Mkdir(filepath.Join(dir, "subdir"), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "empty"), nil, 0o600))
	require.NoError(t, unix.Mkfifo(filepath.Join(dir, "fifo"), 0o600))
	// PROTOCOL.md "Isolation": a hard link in the shm dir to a file outside
	// it (or to another engine's object) has two links and is refused.
	require.NoError(t, os.WriteFile(filepath.Join(outside, "big"), make([]byte, 4096), 0o600))
	require.NoError(t, os.Link(filepath.Join(outside, "big"), filepath.Join(dir, "hard-out")))
	victim := create(t, dir, "vic-kv", 4096)
	require.NoError(t, os.Link(filepath.Join(dir, victim.Name()), filepath.Join(dir, "mal-kv")))
	b := newBackend(t, dir)

	cases := []struct {
		name string
		seg  messages.Segment
		want string
	}{
		{"parent escape", messages.Segment{Shm: "../etc/passwd"}, "contains '/'"},
		{"slash", messages.Segment{Shm: "a/b"}, "contains '/'"},
		{"absolute", messages.Segment{Shm: "/etc/passwd"}, "contains '/'"},
		{"dotdot", messages.Segment{Shm: ".."}, "refers to a directory"},
		{"dot", messages.Segment{Shm: "."}, "refers to a directory"},
		{"empty name", messages.Segment{Shm: ""}, "names no shm object"},
		{"NUL", messages.Segment{Shm: "x\x00y"}, "NUL"},
		{"space", messages.Segment{Shm: "a b"}, "byte ' '"},
		{"non-ASCII", messages.Segment{Shm: "kvä"}, "byte"},
		{"too long", messages.Segment{Shm: strings.Repeat("a", 256)}, "more than 255"},
		{"symlink to a regular file", messages.Segment{Shm: "link-in"}, "is a symlink"},
		{"symlink out of the dir", messages.Segment{Shm: "link-out"}, "is a symlink"},
		{"dangling symlink", messages.Segment{Shm: "link-dangling"}, "is a symlink"},
		{"missing", messages.Segment{Shm: "missing"}, "does not exist"},
		{"directory", messages.Segment{Shm: "subdir"}, "is a directory"},
		{"zero size", messages.Segment{Shm: "empty"}, "is empty"},
		{"fifo", messages.Segment{Shm: "fifo"}, "not a regular file"},
		{"hard link to a file outside", messages.Segment{Shm: "hard-out"}, "has 2 links"},
		{"hard link to another engine's object", messages.Segment{Shm: "mal-kv"}, "has 2 links"},
		{"cuda_ipc", messages.Segment{CUDAIPC: "abcd", Bytes: 4096}, "cuda_ipc"},
		{"both kinds", messages.Segment{Shm: "good", CUDAIPC: "abcd"}, "both"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dev, err := b.Attach("e1", []messages.Segment{good.Spec(), tc.seg})
			require.Nil(t, dev)
			require.ErrorIs(t, err, backend.ErrBadSegment)
			require.ErrorContains(t, err, `engine "e1" segment 1`)
			require.ErrorContains(t, err, tc.want)
		})
	}
	// Nothing outside dir was touched through a link.
	secret, err := os.ReadFile(filepath.Join(outside, "secret"))
	require.NoError(t, err)
	require.Equal(t, "secret", string(secret))
	big, err := os.ReadFile(filepath.Join(outside, "big"))
	require.NoError(t, err)
	require.Equal(t, make([]byte, 4096), big)
}

func TestAttachValidNames(t *testing.T) {
	dir := t.TempDir()
	b := newBackend(t, dir)
	for _, name := range []string{"kvactors-e1", "A.b_c-9", "...", ".hidden", strings.Repeat("x", 255)} {
		s := create(t, dir, name, 100)
		dev, err := b.Attach("e1", []messages.Segment{s.Spec()})
		require.NoError(t, err, name)
		require.Equal(t, int64(100), dev.SegmentSize(0))
		require.Equal(t, int64(0), dev.SegmentSize(1), "no segment 1")
		require.Equal(t, int64(0), dev.SegmentSize(-1), "no segment -1")
		require.NoError(t, dev.Close())
		require.Equal(t, int64(0), dev.SegmentSize(0), "after Close")
	}
}

// TestSharedBothWays: a load writes into the engine's object, visible to the
// engine's own mapping, and what the engine writes is what a store reads.
func TestSharedBothWays(t *testing.T) {
	dir := t.TempDir()
	seg := create(t, dir, "e1", 8192)
	b := newBackend(t, dir)
	dev, err := b.Attach("e1", []messages.Segment{seg.Spec()})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, dev.Close()) })
	arena, err := b.AllocArena(4096)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, arena.Close()) })

	copy(seg.Bytes()[100:], "written by the engine")
	require.NoError(t, dev.Copy(backend.DeviceToHost, arena, []backend.Range{{SegOffset: 100, PoolOff: 0, Len: 21}}))
	require.Equal(t, "written by the engine", string(arena.Bytes()[:21]))

	copy(arena.Bytes()[50:], "loaded by kvactors")
	require.NoError(t, dev.Copy(backend.HostToDevice, arena, []backend.Range{{SegOffset: 5000, PoolOff: 50, Len: 18}}))
	require.Equal(t, "loaded by kvactors", string(seg.Bytes()[5000:5018]))
	onDisk, err := os.ReadFile(filepath.Join(dir, "e1"))
	require.NoError(t, err)
	require.Equal(t, "loaded by kvactors", string(onDisk[5000:5018]), "MAP_SHARED reaches the object")
}

func TestCopyErrors(t *testing.T) {
	dir := t.TempDir()
	seg := create(t, dir, "e1", 4096)
	b := newBackend(t, dir)
	dev, err := b.Attach("e1", []messages.Segment{seg.Spec()})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, dev.Close()) })
	arena, err := b.AllocArena(4096)
	require.NoError(t, err)

	err = dev.Copy(backend.DeviceToHost, arena, []backend.Range{{Len: 1}, {Len: 1}, {SegOffset: 4000, Len: 97}})
	require.ErrorIs(t, err, backend.ErrOutOfRange)
	require.ErrorContains(t, err, "range 2 {Segment:0 SegOffset:4000 PoolOff:0 Len:97}")
	require.ErrorContains(t, err, "past the end of segment 0 (4096 bytes)")

	err = dev.Copy(backend.Direction(7), arena, nil)
	require.ErrorContains(t, err, "unknown direction")

	// A closed arena of this backend is refused rather than touched.
	require.NoError(t, arena.Close())
	require.NoError(t, arena.Close(), "second Close")
	require.Nil(t, arena.Bytes())
	err = dev.Copy(backend.DeviceToHost, arena, []backend.Range{{Len: 1}})
	require.ErrorIs(t, err, backend.ErrClosed)
}

// sliceArena is an Arena from outside this backend: Copy must work on any.
type sliceArena []byte

func (a sliceArena) Bytes() []byte { return a }
func (sliceArena) Close() error    { return nil }

func TestCopyForeignArena(t *testing.T) {
	dir := t.TempDir()
	seg := create(t, dir, "e1", 4096)
	copy(seg.Bytes(), "hello")
	dev, err := newBackend(t, dir).Attach("e1", []messages.Segment{seg.Spec()})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, dev.Close()) })
	a := make(sliceArena, 8)
	require.NoError(t, dev.Copy(backend.DeviceToHost, a, []backend.Range{{PoolOff: 3, Len: 5}}))
	require.Equal(t, "\x00\x00\x00hello", string(a))
}

// TestTruncatedObjectFaults: an engine that shrinks its object while attached
// breaks the contract; the copy fails with ErrFault instead of crashing.
func TestTruncatedObjectFaults(t *testing.T) {
	dir := t.TempDir()
	seg := create(t, dir, "e1", 64<<10)
	b := newBackend(t, dir)
	dev, err := b.Attach("e1", []messages.Segment{seg.Spec()})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, dev.Close()) })
	arena, err := b.AllocArena(64 << 10)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, arena.Close()) })

	require.NoError(t, os.Truncate(filepath.Join(dir, "e1"), 0))
	for _, dir := range []backend.Direction{backend.DeviceToHost, backend.HostToDevice} {
		err = dev.Copy(dir, arena, []backend.Range{{Len: 0}, {SegOffset: 8192, Len: 4096}})
		require.ErrorIs(t, err, shm.ErrFault, "%s", dir)
		require.ErrorContains(t, err, "range 1")
	}
}

func TestAllocArenaRefuses(t *testing.T) {
	b := newBackend(t, t.TempDir())
	for _, n := range []int64{0, -4096} {
		_, err := b.AllocArena(n)
		require.ErrorContains(t, err, "must be > 0")
	}
}

func TestAttachNoSegments(t *testing.T) {
	_, err := newBackend(t, t.TempDir()).Attach("e9", []messages.Segment{})
	require.ErrorIs(t, err, backend.ErrBadSegment)
	require.ErrorContains(t, err, `engine "e9": no segments`)
}

func TestErrorsAreDistinct(t *testing.T) {
	// ErrFault must not be mistaken for a bounds or attach failure upstream.
	require.False(t, errors.Is(shm.ErrFault, backend.ErrOutOfRange))
	require.False(t, errors.Is(shm.ErrFault, backend.ErrBadSegment))
}
