package shm

import (
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
)

// Segment is the engine side of an shm segment: an object the engine created
// and maps shared, so what it writes is what kvactors' Attach sees. Tests,
// the simulated engine and the demo use it; kvactors itself only attaches.
type Segment struct {
	dir, name string

	mu  sync.Mutex
	mem []byte // nil after Close
}

// Create makes a new shm object dir/name of size bytes, zero-filled, and maps
// it shared. The name follows the same rule as Attach (a hostile name is an
// error wrapping backend.ErrBadSegment) and an existing object is never
// reused (O_EXCL): the error then wraps fs.ErrExist.
func Create(dir, name string, size int64) (*Segment, error) {
	if err := checkName(name); err != nil {
		return nil, fmt.Errorf("shm: create %q: %w: %w", name, err, backend.ErrBadSegment)
	}
	if size <= 0 || int64(int(size)) != size {
		return nil, fmt.Errorf("shm: create %q: size %d: must be > 0 and fit in memory", name, size)
	}
	fd, err := openAt(dir, name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL, 0o600)
	if err != nil {
		return nil, fmt.Errorf("shm: create %q in %q: %w", name, dir, err)
	}
	defer unix.Close(fd)
	mem, err := func() ([]byte, error) {
		if err := unix.Ftruncate(fd, size); err != nil {
			return nil, fmt.Errorf("ftruncate to %d: %w", size, err)
		}
		return mapFile(fd, size)
	}()
	if err != nil {
		// Do not leave a half-made object behind for the next Create to trip on.
		_ = unlinkAt(dir, name)
		return nil, fmt.Errorf("shm: create %q in %q: %w", name, dir, err)
	}
	return &Segment{dir: dir, name: name, mem: mem}, nil
}

// Name is the object's name, as it goes into an EngineSpec.
func (s *Segment) Name() string { return s.name }

// Spec is the segment as an EngineSpec lists it.
func (s *Segment) Spec() messages.Segment { return messages.Segment{Shm: s.name} }

// Bytes is the shared memory; valid until Close or Remove, nil after.
func (s *Segment) Bytes() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mem
}

// Close unmaps the memory and leaves the object in place (an attached
// kvactors keeps its own mapping). Closing twice is fine.
func (s *Segment) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mem == nil {
		return nil
	}
	mem := s.mem
	s.mem = nil
	if err := unix.Munmap(mem); err != nil {
		return fmt.Errorf("shm: %q: munmap: %w", s.name, err)
	}
	return nil
}

// Remove unmaps the memory and unlinks the object. An object already gone is
// not an error, so Remove can run from more than one cleanup path.
func (s *Segment) Remove() error {
	err := s.Close()
	if uerr := unlinkAt(s.dir, s.name); uerr != nil && !errors.Is(uerr, unix.ENOENT) {
		err = errors.Join(err, fmt.Errorf("shm: %q: unlink: %w", s.name, uerr))
	}
	return err
}

// unlinkAt removes a checked name relative to dir, like openAt.
func unlinkAt(dir, name string) error {
	dirfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(dirfd)
	return unix.Unlinkat(dirfd, name, 0)
}
