package shm_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/backend/shm"
	"github.com/kvactors/kvactors/messages"
)

// Recheck passes while the name still names the mapped object, and fails
// with ErrReplaced once it names anything else: a restarted engine's new
// object, nothing, a symlink, or the same inode with a second link (which
// Attach would refuse).
func TestRecheckSeesTheObjectBehindTheNameChange(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, dir string)
		want   string
	}{
		{"unchanged", func(*testing.T, string) {}, ""},
		{"recreated under the same name", func(t *testing.T, dir string) {
			require.NoError(t, os.Remove(filepath.Join(dir, "e1-kv")))
			require.NoError(t, os.WriteFile(filepath.Join(dir, "e1-kv"), make([]byte, 4096), 0o600))
		}, "not the attached"},
		{"unlinked", func(t *testing.T, dir string) {
			require.NoError(t, os.Remove(filepath.Join(dir, "e1-kv")))
		}, "does not exist"},
		{"replaced by a symlink to itself elsewhere", func(t *testing.T, dir string) {
			other := filepath.Join(t.TempDir(), "kv")
			require.NoError(t, os.Rename(filepath.Join(dir, "e1-kv"), other))
			require.NoError(t, os.Symlink(other, filepath.Join(dir, "e1-kv")))
		}, "not the attached"},
		{"a second link added", func(t *testing.T, dir string) {
			require.NoError(t, os.Link(filepath.Join(dir, "e1-kv"), filepath.Join(dir, "alias")))
		}, "has 2 links"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			require.NoError(t, os.WriteFile(filepath.Join(dir, "e1-kv"), make([]byte, 4096), 0o600))
			b, err := shm.New(shm.Config{Dir: dir})
			require.NoError(t, err)
			dev, err := b.AttachSpans("e1", []messages.Segment{{Shm: "e1-kv"}}, []backend.Span{{Off: 0, End: 4096}})
			require.NoError(t, err)
			t.Cleanup(func() { _ = dev.Close() })
			rc, ok := dev.(backend.Rechecker)
			require.True(t, ok, "the shm attachment can recheck its names")
			require.NoError(t, rc.Recheck(), "just attached")
			tc.change(t, dir)
			err = rc.Recheck()
			if tc.want == "" {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, backend.ErrReplaced)
			require.ErrorContains(t, err, tc.want)
			require.ErrorContains(t, err, `"e1-kv"`)
		})
	}
}
