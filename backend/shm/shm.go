package shm

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
)

// pageSize is the granularity of mappings: a span is mapped from its first
// byte's page to its last byte's.
var pageSize = int64(os.Getpagesize())

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

// Attach maps the whole of every segment of the engine, in spec order. It
// is all or nothing: on an error in segment k, segments 0..k-1 are unmapped
// again. The node uses AttachSpans, which maps only what regions use.
func (b *Backend) Attach(engine string, segs []messages.Segment) (backend.Attachment, error) {
	return b.attach(engine, segs, nil)
}

var _ backend.SpanAttacher = (*Backend)(nil)

// AttachSpans maps, of each segment, only the pages of spans[i] (rounded out
// to whole pages), so a huge sparse object whose regions use a little of it
// costs the node only that little address space. A span past the end of its
// object is refused (ErrBadSegment); otherwise as Attach.
func (b *Backend) AttachSpans(engine string, segs []messages.Segment, spans []backend.Span) (backend.Attachment, error) {
	if len(spans) != len(segs) {
		return nil, fmt.Errorf("shm: engine %q: %d spans for %d segments: %w", engine, len(spans), len(segs),
			backend.ErrBadSegment)
	}
	return b.attach(engine, segs, spans)
}

// attach maps segs, each whole when spans is nil, else the pages of its span.
func (b *Backend) attach(engine string, segs []messages.Segment, spans []backend.Span) (backend.Attachment, error) {
	if len(segs) == 0 {
		return nil, fmt.Errorf("shm: engine %q: no segments: %w", engine, backend.ErrBadSegment)
	}
	mapped := make([]mapping, 0, len(segs))
	for i, s := range segs {
		var span *backend.Span
		if spans != nil {
			span = &spans[i]
		}
		m, err := b.attachOne(s, span)
		if err != nil {
			for _, m := range mapped {
				_ = unix.Munmap(m.mem)
			}
			return nil, fmt.Errorf("shm: engine %q segment %d (shm %q): %w: %w",
				engine, i, s.Shm, err, backend.ErrBadSegment)
		}
		mapped = append(mapped, m)
	}
	return &device{engine: engine, dir: b.dir, segs: mapped}, nil
}

// attachOne opens and maps one segment: the whole object when span is nil,
// else the pages of span. Its error is the reason only; attach adds which
// engine and segment, and ErrBadSegment.
func (b *Backend) attachOne(s messages.Segment, span *backend.Span) (mapping, error) {
	switch {
	case s.CUDAIPC != "" && s.Shm != "":
		return mapping{}, errors.New("sets both shm and cuda_ipc")
	case s.CUDAIPC != "":
		return mapping{}, errors.New("is a cuda_ipc segment; the shm backend attaches only shm segments (use the cuda backend)")
	case s.Shm == "":
		return mapping{}, errors.New("names no shm object")
	}
	if err := checkName(s.Shm); err != nil {
		return mapping{}, err
	}
	fd, st, err := openOwned(b.dir, s.Shm)
	if err != nil {
		return mapping{}, err
	}
	// The mapping keeps the object alive; the fd is not needed after mmap.
	defer unix.Close(fd)
	switch {
	case st.Size <= 0:
		return mapping{}, errors.New("is empty (size 0)")
	case int64(int(st.Size)) != st.Size:
		return mapping{}, fmt.Errorf("size %d is too large for this platform", st.Size)
	}
	want := backend.Span{Off: 0, End: st.Size}
	if span != nil {
		if span.Off < 0 || span.End <= span.Off || span.End > st.Size {
			return mapping{}, fmt.Errorf("regions use bytes [%d, %d), past segment's end at %d", span.Off, span.End, st.Size)
		}
		want = *span
	}
	// mmap wants a page-aligned offset; the kernel rounds the length up to
	// the page itself (bytes of that page past want.End are never touched:
	// a copy is checked against want).
	base := want.Off &^ (pageSize - 1)
	mem, err := mapFileAt(fd, base, want.End-base)
	if err != nil {
		return mapping{}, err
	}
	return mapping{mem: mem, base: base, lo: want.Off, size: st.Size, name: s.Shm, dev: uint64(st.Dev), ino: st.Ino}, nil
}
