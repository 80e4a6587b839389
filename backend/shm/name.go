package shm

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// maxNameLen is NAME_MAX on Linux: a longer name cannot be a single file.
const maxNameLen = 255

// checkName enforces PROTOCOL.md's "NAME is a plain file name": 1..255 bytes
// of [A-Za-z0-9._-], not "." or "..". The charset alone excludes "/" and NUL;
// they get their own reasons because they are the hostile cases worth naming.
func checkName(name string) error {
	switch {
	case name == "":
		return errors.New("empty name")
	case len(name) > maxNameLen:
		return fmt.Errorf("name is %d bytes, more than %d", len(name), maxNameLen)
	case name == "." || name == "..":
		return fmt.Errorf("name %q refers to a directory", name)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		switch {
		case c == '/':
			return errors.New("name contains '/'")
		case c == 0:
			return errors.New("name contains a NUL byte")
		case !nameByte(c):
			return fmt.Errorf("name contains byte %q at %d (allowed: A-Z a-z 0-9 . _ -)", c, i)
		}
	}
	return nil
}

func nameByte(c byte) bool {
	return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' ||
		c == '.' || c == '_' || c == '-'
}

// openAt opens name relative to dir. Going through a directory fd plus
// O_NOFOLLOW means neither a symlink planted as the object nor a checked name
// reinterpreted against another cwd can redirect us. O_NONBLOCK keeps a FIFO
// planted in the directory from blocking the open; fstat rejects it after.
func openAt(dir, name string, flags int, perm uint32) (int, error) {
	dirfd, err := openDir(dir)
	if err != nil {
		return -1, err
	}
	defer unix.Close(dirfd)
	return openIn(dirfd, name, flags, perm)
}

func openDir(dir string) (int, error) {
	dirfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open directory %q: %w", dir, err)
	}
	return dirfd, nil
}

func openIn(dirfd int, name string, flags int, perm uint32) (int, error) {
	for {
		fd, err := unix.Openat(dirfd, name, flags|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, perm)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return -1, openReason(err)
		}
		return fd, nil
	}
}

// afterStat runs between the pre-open check and the open of an attached
// segment; tests swap the object there to prove the re-check closes the
// window.
var afterStat = func() {}

// openOwned opens name in dir for Attach (PROTOCOL.md "Isolation", segment
// ownership): the object must be a regular file with exactly one link, not a
// symlink, in dir itself. It is checked with fstatat (no symlink followed)
// before anything is opened, so a FIFO, device or link is never even opened,
// and again with fstat after the open, which must see the very same inode
// still with one link: a swap between the two calls is refused. One link
// rules out a hard link to a file outside dir (or to another engine's
// object), which would otherwise pass every name check.
func openOwned(dir, name string) (int, unix.Stat_t, error) {
	var st unix.Stat_t
	dirfd, err := openDir(dir)
	if err != nil {
		return -1, st, err
	}
	defer unix.Close(dirfd)
	var pre unix.Stat_t
	if err := unix.Fstatat(dirfd, name, &pre, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return -1, st, openReason(err)
	}
	if err := ownedFile(&pre); err != nil {
		return -1, st, err
	}
	afterStat()
	fd, err := openIn(dirfd, name, unix.O_RDWR, 0)
	if err != nil {
		return -1, st, err
	}
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return -1, st, fmt.Errorf("fstat: %w", err)
	}
	if err := ownedFile(&st); err != nil {
		unix.Close(fd)
		return -1, st, fmt.Errorf("after open: %w", err)
	}
	if st.Dev != pre.Dev || st.Ino != pre.Ino {
		unix.Close(fd)
		return -1, st, errors.New("was replaced between check and open")
	}
	return fd, st, nil
}

// ownedFile says why st is not a segment object kvactors may map.
func ownedFile(st *unix.Stat_t) error {
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
	case unix.S_IFLNK:
		return errors.New("is a symlink")
	case unix.S_IFDIR:
		return errors.New("is a directory")
	default:
		return fmt.Errorf("is not a regular file (mode %#o)", st.Mode&unix.S_IFMT)
	}
	if st.Nlink != 1 {
		return fmt.Errorf("has %d links, want 1 (a hard link may point outside the shm directory)", st.Nlink)
	}
	return nil
}

// openReason says in words what an openat errno means for a segment.
func openReason(err error) error {
	switch err {
	case unix.ELOOP:
		return fmt.Errorf("is a symlink: %w", err)
	case unix.ENOENT:
		return fmt.Errorf("does not exist: %w", err)
	case unix.EISDIR:
		return fmt.Errorf("is a directory: %w", err)
	case unix.EEXIST:
		return fmt.Errorf("already exists: %w", err)
	}
	return fmt.Errorf("open: %w", err)
}

// mapFile maps size bytes of fd shared and read/write: stores read the
// engine's memory and loads write into it.
func mapFile(fd int, size int64) ([]byte, error) {
	return mapFileAt(fd, 0, size)
}

// mapFileAt maps bytes [off, off+size) of fd shared, read/write; off is a
// multiple of the page size.
func mapFileAt(fd int, off, size int64) ([]byte, error) {
	b, err := unix.Mmap(fd, off, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %d bytes at %d: %w", size, off, err)
	}
	return b, nil
}
