package disk

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

func segFiles(t *testing.T, dir string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*"+segSuffix))
	require.NoError(t, err)
	return files
}

// openWithOneRecord opens a tier on dir and spills one 100-byte record,
// key(1), waiting until it is on disk; it returns the tier and the bytes.
func openWithOneRecord(t *testing.T, dir string) (*Disk, []byte) {
	t.Helper()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	c := bytes.Repeat([]byte{7}, 100)
	require.True(t, d.Spill("e", key(1), sum(c), c))
	waitOnDisk(t, d, key(1))
	return d, c
}

// An Open after a boot that left a live chunk in its segment starts a new
// segment; one a boot never writes must not stay behind while an older
// segment still holds a live record (old segments go only from the front):
// a crash loop would add a file, and an open descriptor at every later
// Open, per restart.
func TestRestartsDoNotPileUpEmptySegments(t *testing.T) {
	dir := t.TempDir()
	d, c := openWithOneRecord(t, dir)
	d.Close()
	for range 50 {
		d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
		require.NoError(t, err)
		d.Close()
	}
	require.Len(t, segFiles(t, dir), 2, "the live record's segment and the last boot's")
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	defer d.Close()
	got := make([]byte, len(c))
	_, err = d.readInto("e", key(1), [][]byte{got})
	require.NoError(t, err)
	require.Equal(t, c, got, "the live record survives")
}

// A boot that only drops chunks (a load finds them bad or too large for
// the pool) writes only their tombstones; in a crash loop each boot's
// tombstones went to a segment of its own, which no drop deletes while an
// older segment holds a live chunk: a file, and an open descriptor at
// every later Open, per restart. A boot appends to the newest segment
// where it holds no live chunk, so they pile up no more, and every dropped
// chunk stays dropped.
func TestRestartsThatOnlyDropDoNotPileUpTombstoneSegments(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	c := bytes.Repeat([]byte{5}, 100)
	for i := range 30 {
		require.True(t, d.Spill("e", key(i), sum(c), c))
	}
	waitOnDisk(t, d, key(29))
	d.Close()
	for i := range 20 {
		d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
		require.NoError(t, err)
		d.Drop("e", key(i))
		d.Close() // writes the tombstone
	}
	require.Len(t, segFiles(t, dir), 2, "the live chunks' segment and the tombstones'")
	d, err = Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	defer d.Close()
	var want []messages.Key
	for i := 20; i < 30; i++ {
		want = append(want, key(i))
	}
	require.Equal(t, want, d.Keys(), "the dropped chunks stay dropped")
	c2 := bytes.Repeat([]byte{6}, 100)
	require.True(t, d.Spill("e", key(30), sum(c2), c2)) // appended after the tombstones
	waitOnDisk(t, d, key(30))
	d.Close()
	d, err = Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	defer d.Close()
	require.Equal(t, append(want, key(30)), d.Keys())
	got, err := readBack(t, d, key(30), len(c2))
	require.NoError(t, err)
	require.Equal(t, c2, got)
}

// A file in the disk directory that is not one of the tier's own names
// (a copy or restore named "7.kvseg", "+1.kvseg") is left alone: it stops
// no Open, and is not scanned as a second segment over a live one (which
// would count its records replaced and delete the live file).
func TestStraySegmentNamesAreNotOurs(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "7.kvseg"), nil, 0o600))
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err, "a short name stops no Open")
	c := bytes.Repeat([]byte{7}, 100)
	require.True(t, d.Spill("e", key(1), sum(c), c))
	waitOnDisk(t, d, key(1))
	path, _, _ := d.Where(key(1))
	d.Close()
	require.NoError(t, os.Link(path, filepath.Join(dir, "+"+filepath.Base(path)[len("0000000"):])))
	d2, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	defer d2.Close()
	_, err = os.Stat(path)
	require.NoError(t, err, "the segment holding the live record is still there")
	require.Equal(t, []messages.Key{key(1)}, d2.Keys())
	_, err = os.Stat(filepath.Join(dir, "7.kvseg"))
	require.NoError(t, err, "a file not ours is not removed")
}

// A tombstone names its record's segment in 32 bits: a segment id past
// that (a file named so) is not ours, and the ids never reach it, so a
// dropped record stays dropped across a restart.
func TestSegmentIDsStayWithin32Bits(t *testing.T) {
	dir := t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "4294967296"+segSuffix), nil, 0o600))
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	c := bytes.Repeat([]byte{7}, 100)
	require.True(t, d.Spill("e", key(1), sum(c), c))
	waitOnDisk(t, d, key(1))
	d.Drop("e", key(1))
	d.Close()
	d2, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	require.Empty(t, d2.Keys(), "a dropped record stays dropped")
	d2.Close()

	// The last id a tombstone can name: the next segment would be past it.
	dir = t.TempDir()
	c2 := bytes.Repeat([]byte{8}, 100)
	raw := appendHeader(nil, string(key(2)), int64(len(c2)), sum(c2))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "4294967295"+segSuffix), append(raw, c2...), 0o600))
	_, err = Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.ErrorContains(t, err, "segment ids exhausted")
}

// A name of the tier's own form that is not a regular file (a symlink to a
// segment moved elsewhere, a directory) is not read, and is not in the
// writer's way either: the writer's segment ids step past it, so Open
// does not fail on it (O_EXCL found the name taken) and the writer does
// not stop writing once its ids reach it (every later spill failed).
// What the symlink names is never touched.
func TestSegmentNamesTakenByStrayEntriesAreSteppedPast(t *testing.T) {
	dir, outside := t.TempDir(), t.TempDir()
	target := filepath.Join(outside, "moved")
	require.NoError(t, os.WriteFile(target, []byte("not a segment"), 0o600))
	require.NoError(t, os.Symlink(target, filepath.Join(dir, "00000001"+segSuffix)))
	require.NoError(t, os.Mkdir(filepath.Join(dir, "00000003"+segSuffix), 0o700))

	cfg := Config{Dir: dir, Bytes: 1 << 20, SegmentBytes: 1000}
	d, err := Open(cfg, nil)
	require.NoError(t, err, "a stray entry at the next segment id stops no Open")
	c := bytes.Repeat([]byte{7}, 600) // one record per segment: each spill rolls
	keys := []messages.Key{key(1), key(2), key(3), key(4)}
	for _, k := range keys {
		require.True(t, d.Spill("e", k, sum(c), c))
		waitOnDisk(t, d, k)
	}
	require.Zero(t, d.Stats().Failed, "no write failed on a stray entry")
	d.Close()

	d2, err := Open(cfg, nil)
	require.NoError(t, err)
	defer d2.Close()
	require.Equal(t, keys, d2.Keys())
	for _, k := range keys {
		got := make([]byte, len(c))
		_, err := d2.readInto("e", k, [][]byte{got})
		require.NoError(t, err)
		require.Equal(t, c, got)
	}
	b, err := os.ReadFile(target)
	require.NoError(t, err)
	require.Equal(t, "not a segment", string(b), "what the symlink names is untouched")
}

// A LOCK that is a symlink is not followed out of the directory: Open
// neither creates nor locks what it names (an empty file created
// wherever the link points, by a node that may run as root), it refuses,
// naming the file.
func TestALockThatIsASymlinkIsNotFollowed(t *testing.T) {
	dir, outside := t.TempDir(), t.TempDir()
	target := filepath.Join(outside, "created-by-the-node")
	require.NoError(t, os.Symlink(target, filepath.Join(dir, lockName)))
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	if err == nil {
		d.Close()
	}
	_, serr := os.Lstat(target)
	require.ErrorIs(t, serr, os.ErrNotExist, "nothing is created outside the directory")
	require.ErrorContains(t, err, lockName)
}

// A segment the rebuild listed as a regular file and that was swapped for
// a link before the rebuild opened it is not followed: read as a segment,
// the file it points to (anywhere, the node's user's) had its "torn tail"
// cut, to nothing. It is left alone as the listing leaves what is not
// ours, and its records are not served.
func TestASegmentSwappedForALinkAfterTheListingIsNotFollowed(t *testing.T) {
	dir := t.TempDir()
	d, c := openWithOneRecord(t, dir)
	d.Close()

	victim := filepath.Join(t.TempDir(), "victim")
	want := []byte("not a segment: a file of the node's user, outside the directory\n")
	require.NoError(t, os.WriteFile(victim, want, 0o600))
	swapped := ""
	swap := func(path string) {
		if swapped != "" {
			return
		}
		swapped = path
		require.NoError(t, os.Rename(path, path+".moved"))
		require.NoError(t, os.Symlink(victim, path))
	}
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20, beforeOpen: swap}, nil)
	require.NoError(t, err)
	defer d.Close()
	require.NotEmpty(t, swapped, "the rebuild opened a listed segment")
	got, err := os.ReadFile(victim)
	require.NoError(t, err)
	require.Equal(t, want, got, "the link's target is untouched")
	_, err = d.readInto("e", key(1), [][]byte{make([]byte, len(c))})
	require.ErrorIs(t, err, ErrMissing, "the swapped segment's record is not served")
}

// Segments are walked in id order, not in their names' order: past
// 99999999 a name grows a digit ("100000000.kvseg" sorts before
// "99999999.kvseg"), and walked in name order the older records would
// come back as the newest.
func TestSegmentsPastEightDigitsAreWalkedInIDOrder(t *testing.T) {
	dir := t.TempDir()
	cfg := Config{Dir: dir, Bytes: 1 << 20}
	d, err := Open(cfg, nil)
	require.NoError(t, err)
	c := bytes.Repeat([]byte{4}, 100)
	require.True(t, d.Spill("e", key(1), sum(c), c))
	waitOnDisk(t, d, key(1))
	d.Close()
	require.NoError(t, os.Rename(filepath.Join(dir, "00000001"+segSuffix), filepath.Join(dir, "99999999"+segSuffix)))
	d, err = Open(cfg, nil)
	require.NoError(t, err)
	require.True(t, d.Spill("e", key(2), sum(c), c))
	waitOnDisk(t, d, key(2))
	path, _, _ := d.Where(key(2))
	require.Equal(t, "100000000"+segSuffix, filepath.Base(path))
	d.Close()

	d, err = Open(cfg, nil)
	require.NoError(t, err)
	require.Equal(t, []messages.Key{key(1), key(2)}, d.Keys(), "write order")
	d.Close()
	d, err = Open(Config{Dir: dir, Bytes: 100}, nil) // room for the newest only
	require.NoError(t, err)
	defer d.Close()
	require.Equal(t, []messages.Key{key(2)}, d.Keys())
}
