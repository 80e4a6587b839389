package shm

import (
	"fmt"

	"golang.org/x/sys/unix"

	"github.com/kvactors/kvactors/backend"
)

var (
	_ backend.Rechecker = (*device)(nil)
	_ backend.Objects   = (*device)(nil)
)

// Recheck says whether every segment's name still names the object mapped
// at attach: fstatat in the shm directory, no link followed, nothing opened.
// An engine that restarted unlinked its object and created a new one under
// the same name; the mapping still holds the old inode, which only the dead
// process wrote (PROTOCOL.md "EngineSpec"). A name that is missing, names
// another inode, or no longer passes what Attach demands (a regular file
// with one link) is ErrReplaced.
func (d *device) Recheck() error {
	d.mu.RLock()
	defer d.mu.RUnlock()
	if d.closed {
		return fmt.Errorf("shm: engine %q: device: %w", d.engine, backend.ErrClosed)
	}
	dirfd, err := openDir(d.dir)
	if err != nil {
		return fmt.Errorf("shm: engine %q: %w", d.engine, err)
	}
	defer unix.Close(dirfd)
	for i, m := range d.segs {
		var st unix.Stat_t
		err := unix.Fstatat(dirfd, m.name, &st, unix.AT_SYMLINK_NOFOLLOW)
		switch {
		case err != nil:
			err = openReason(err)
		case uint64(st.Dev) != m.dev || st.Ino != m.ino:
			err = fmt.Errorf("names inode %d, not the attached %d", st.Ino, m.ino)
		default:
			err = ownedFile(&st)
		}
		if err != nil {
			return fmt.Errorf("shm: engine %q segment %d (shm %q): %w: %w", d.engine, i, m.name, err, backend.ErrReplaced)
		}
	}
	return nil
}

// Objects returns the device and inode each segment's name named at attach.
func (d *device) Objects() []backend.Object {
	d.mu.RLock()
	defer d.mu.RUnlock()
	out := make([]backend.Object, len(d.segs))
	for i, m := range d.segs {
		out[i] = backend.Object{Dev: m.dev, Ino: m.ino}
	}
	return out
}
