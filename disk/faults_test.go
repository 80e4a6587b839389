package disk

import (
	"bytes"
	"io"
	"os"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// failingReader reads r until at bytes have been read, then fails as a
// disk does (EIO), once, the file itself unharmed.
type failingReader struct {
	r  io.Reader
	at int64
	n  int64
}

func (f *failingReader) Read(p []byte) (int, error) {
	if f.n >= f.at {
		return 0, &os.PathError{Op: "read", Path: "segment", Err: syscall.EIO}
	}
	p = p[:min(int64(len(p)), f.at-f.n)]
	n, err := f.r.Read(p)
	f.n += int64(n)
	return n, err
}

// A read that fails at open (EIO) is not a torn tail: the open fails,
// naming the segment and the error, and cuts nothing, so the records after
// the failure are all there at the next open.
func TestAReadErrorAtOpenFailsItAndCutsNothing(t *testing.T) {
	dir := t.TempDir()
	d, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err)
	c := bytes.Repeat([]byte{3}, 1000)
	for i := range 3 {
		require.True(t, d.Spill("e", key(i), sum(c), c))
		waitOnDisk(t, d, key(i))
	}
	path, off, _ := d.Where(key(1))
	d.Close()
	before, err := os.Stat(path)
	require.NoError(t, err)

	fail := func(p string, r io.Reader) io.Reader {
		if p != path {
			return r
		}
		return &failingReader{r: r, at: off + 10} // inside key(1)'s data
	}
	_, err = Open(Config{Dir: dir, Bytes: 1 << 20, readSegment: fail}, nil)
	require.ErrorIs(t, err, syscall.EIO)
	require.ErrorContains(t, err, path)
	after, err := os.Stat(path)
	require.NoError(t, err)
	require.Equal(t, before.Size(), after.Size(), "nothing cut")

	d2, err := Open(Config{Dir: dir, Bytes: 1 << 20}, nil)
	require.NoError(t, err, "the directory is not left locked")
	defer d2.Close()
	for i := range 3 {
		got, err := readBack(t, d2, key(i), len(c))
		require.NoError(t, err)
		require.Equal(t, c, got)
	}
	require.Zero(t, d2.Stats().Discarded)
}
