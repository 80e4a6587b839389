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
	dirfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("open directory %q: %w", dir, err)
	}
	defer unix.Close(dirfd)
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
	b, err := unix.Mmap(fd, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %d bytes: %w", size, err)
	}
	return b, nil
}
