package shm

import (
	"errors"
	"fmt"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
)

// DefaultDir is where POSIX shm_open(3) puts its objects on Linux.
const DefaultDir = "/dev/shm"

// Config configures the shm backend.
type Config struct {
	// Dir is the directory holding the engines' shm objects. It must be an
	// absolute path to an existing directory; default DefaultDir. Segment
	// names are resolved inside it and never leave it.
	Dir string
}

// DefaultConfig returns the configuration used when none is given.
func DefaultConfig() Config {
	return Config{Dir: DefaultDir}
}

// Validate checks the settings that can be checked without touching the
// filesystem; New checks that Dir exists.
func (c Config) Validate() error {
	switch {
	case c.Dir == "":
		return errors.New("shm: Dir is empty")
	case !filepath.IsAbs(c.Dir):
		// A relative Dir would resolve against whatever the cwd is.
		return fmt.Errorf("shm: Dir %q is not an absolute path", c.Dir)
	}
	return nil
}

// Backend is the shm backend. It holds no mutable state, so it is safe for
// concurrent use.
type Backend struct {
	dir string
}

var _ backend.Backend = (*Backend)(nil)

// New validates cfg and checks that cfg.Dir is a directory we can open, so a
// misconfiguration fails at start-up rather than at the first register.
func New(cfg Config) (*Backend, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	fd, err := unix.Open(cfg.Dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("shm: open Dir %q: %w", cfg.Dir, err)
	}
	_ = unix.Close(fd)
	return &Backend{dir: filepath.Clean(cfg.Dir)}, nil
}

// Name returns "shm".
func (b *Backend) Name() string { return "shm" }

// Dir returns the directory segments are resolved in.
func (b *Backend) Dir() string { return b.dir }

// AllocArena maps bytes of anonymous private memory for the host pool,
// pre-faulted (MAP_POPULATE): a pool is meant to be resident, and faulting
// its pages in on the first store of each slot cut store bandwidth to a few
// hundred MB/s (measured by the demo).
func (b *Backend) AllocArena(bytes int64) (backend.Arena, error) {
	if bytes <= 0 {
		return nil, fmt.Errorf("shm: arena of %d bytes: size must be > 0", bytes)
	}
	if int64(int(bytes)) != bytes {
		return nil, fmt.Errorf("shm: arena of %d bytes: too large for this platform", bytes)
	}
	mem, err := unix.Mmap(-1, 0, int(bytes), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE|unix.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("shm: arena of %d bytes: mmap: %w", bytes, err)
	}
	return &arena{mem: mem}, nil
}

// Attach maps every segment of the engine, in spec order. It is all or
// nothing: on an error in segment k, segments 0..k-1 are unmapped again.
func (b *Backend) Attach(engine string, segs []messages.Segment) (backend.Attachment, error) {
	if len(segs) == 0 {
		return nil, fmt.Errorf("shm: engine %q: no segments: %w", engine, backend.ErrBadSegment)
	}
	mapped := make([][]byte, 0, len(segs))
	for i, s := range segs {
		mem, err := b.attachOne(s)
		if err != nil {
			for _, m := range mapped {
				_ = unix.Munmap(m)
			}
			return nil, fmt.Errorf("shm: engine %q segment %d (shm %q): %w: %w",
				engine, i, s.Shm, err, backend.ErrBadSegment)
		}
		mapped = append(mapped, mem)
	}
	return &device{engine: engine, segs: mapped}, nil
}

// attachOne opens and maps one segment. Its error is the reason only; Attach
// adds which engine and segment, and ErrBadSegment.
func (b *Backend) attachOne(s messages.Segment) ([]byte, error) {
	switch {
	case s.CUDAIPC != "" && s.Shm != "":
		return nil, errors.New("sets both shm and cuda_ipc")
	case s.CUDAIPC != "":
		return nil, errors.New("is a cuda_ipc segment; the shm backend attaches only shm segments (use the cuda backend)")
	case s.Shm == "":
		return nil, errors.New("names no shm object")
	}
	if err := checkName(s.Shm); err != nil {
		return nil, err
	}
	fd, st, err := openOwned(b.dir, s.Shm)
	if err != nil {
		return nil, err
	}
	// The mapping keeps the object alive; the fd is not needed after mmap.
	defer unix.Close(fd)
	switch {
	case st.Size <= 0:
		return nil, errors.New("is empty (size 0)")
	case int64(int(st.Size)) != st.Size:
		return nil, fmt.Errorf("size %d is too large for this platform", st.Size)
	}
	return mapFile(fd, st.Size)
}
