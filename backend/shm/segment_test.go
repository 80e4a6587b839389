package shm_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/messages"
)

func TestCreate(t *testing.T) {
	dir := t.TempDir()
	s, err := shm.Create(dir, "kvactors-e1", 10000)
	require.NoError(t, err)
	require.Equal(t, "kvactors-e1", s.Name())
	require.Equal(t, messages.Segment{Shm: "kvactors-e1"}, s.Spec())
	require.Len(t, s.Bytes(), 10000)
	require.Equal(t, make([]byte, 10000), s.Bytes(), "zero-filled")

	st, err := os.Stat(filepath.Join(dir, "kvactors-e1"))
	require.NoError(t, err)
	require.Equal(t, int64(10000), st.Size())
	require.Equal(t, fs.FileMode(0o600), st.Mode().Perm(), "only the owner may map the KV cache")

	_, err = shm.Create(dir, "kvactors-e1", 10000)
	require.ErrorIs(t, err, fs.ErrExist, "O_EXCL: never reuse an object")

	copy(s.Bytes(), "kept")
	require.NoError(t, s.Close())
	require.NoError(t, s.Close(), "second Close")
	require.Nil(t, s.Bytes())
	data, err := os.ReadFile(filepath.Join(dir, "kvactors-e1"))
	require.NoError(t, err)
	require.Equal(t, "kept", string(data[:4]), "Close keeps the object")

	require.NoError(t, s.Remove())
	_, err = os.Stat(filepath.Join(dir, "kvactors-e1"))
	require.ErrorIs(t, err, fs.ErrNotExist)
	require.NoError(t, s.Remove(), "second Remove")
}

func TestCreateRefuses(t *testing.T) {
	dir := t.TempDir()
	outside := t.TempDir()
	require.NoError(t, os.Symlink(filepath.Join(outside, "target"), filepath.Join(dir, "link")))
	for _, name := range []string{"../etc/passwd", "a/b", "..", ".", "", "x\x00y"} {
		_, err := shm.Create(dir, name, 4096)
		require.ErrorIs(t, err, backend.ErrBadSegment, "%q", name)
	}
	for _, size := range []int64{0, -1} {
		_, err := shm.Create(dir, "ok", size)
		require.ErrorContains(t, err, "must be > 0")
	}
	_, err := shm.Create(dir, "link", 4096)
	require.ErrorIs(t, err, fs.ErrExist, "a planted symlink is not followed")
	_, err = os.Stat(filepath.Join(outside, "target"))
	require.ErrorIs(t, err, fs.ErrNotExist, "nothing created through the link")
	_, err = shm.Create(filepath.Join(dir, "missing"), "ok", 4096)
	require.ErrorIs(t, err, fs.ErrNotExist)

	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "only the planted link; no half-made objects")
}
