package shm

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
)

// PROTOCOL.md "Isolation": the object is checked before the open and again
// after it. Each case swaps the checked object between the two (the TOCTOU
// window an attacker races for) and Attach must refuse, mapping nothing.
func TestAttachRefusesSwapAfterCheck(t *testing.T) {
	for _, tc := range []struct {
		name string
		swap func(t *testing.T, dir, outside string)
		want string
	}{
		{"replaced by a hard link to a file outside", func(t *testing.T, dir, outside string) {
			require.NoError(t, os.Remove(filepath.Join(dir, "e1-kv")))
			require.NoError(t, os.Link(filepath.Join(outside, "secret"), filepath.Join(dir, "e1-kv")))
		}, "after open: has 2 links"},
		{"a second link added", func(t *testing.T, dir, outside string) {
			require.NoError(t, os.Link(filepath.Join(dir, "e1-kv"), filepath.Join(outside, "alias")))
		}, "after open: has 2 links"},
		{"replaced by another one-link file", func(t *testing.T, dir, outside string) {
			require.NoError(t, os.Rename(filepath.Join(outside, "secret"), filepath.Join(dir, "e1-kv")))
		}, "replaced between check and open"},
		{"replaced by a symlink", func(t *testing.T, dir, outside string) {
			require.NoError(t, os.Remove(filepath.Join(dir, "e1-kv")))
			require.NoError(t, os.Symlink(filepath.Join(outside, "secret"), filepath.Join(dir, "e1-kv")))
		}, "is a symlink"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, outside := t.TempDir(), t.TempDir()
			require.NoError(t, os.WriteFile(filepath.Join(dir, "e1-kv"), make([]byte, 4096), 0o600))
			secret := []byte("secret bytes of someone else, 4096 long")
			secret = append(secret, make([]byte, 4096-len(secret))...)
			require.NoError(t, os.WriteFile(filepath.Join(outside, "secret"), secret, 0o600))
			b, err := New(Config{Dir: dir})
			require.NoError(t, err)
			afterStat = func() { tc.swap(t, dir, outside) }
			t.Cleanup(func() { afterStat = func() {} })
			dev, err := b.Attach("e1", []messages.Segment{{Shm: "e1-kv"}})
			require.Nil(t, dev)
			require.ErrorIs(t, err, backend.ErrBadSegment)
			require.ErrorContains(t, err, tc.want)
		})
	}
}
