package backend

import (
	"errors"

	"github.com/kvactors/kvactors/messages"
)

// Direction of a copy.
type Direction uint8

const (
	// DeviceToHost copies engine (GPU) memory into the host pool: a store.
	DeviceToHost Direction = iota
	// HostToDevice copies host pool memory into engine (GPU) memory: a load.
	HostToDevice
)

// Directions are both directions (metrics preset their labels at 0).
var Directions = []Direction{DeviceToHost, HostToDevice}

// String returns the vLLM transfer_type label for the direction.
func (d Direction) String() string {
	if d == HostToDevice {
		return "CPU_to_GPU"
	}
	return "GPU_to_CPU"
}

// Range is one contiguous copy between a device segment and the pool arena.
type Range struct {
	Segment   int   // index into the engine's segments
	SegOffset int64 // byte offset in that segment
	PoolOff   int64 // byte offset in the pool arena
	Len       int64
}

// Errors shared by backends.
var (
	// ErrNotBuilt is returned by a backend compiled out of this binary (the
	// cuda backend without the cuda build tag).
	ErrNotBuilt = errors.New("backend not built into this binary")
	// ErrBadSegment is returned for a segment the backend refuses to attach
	// (hostile name, missing object, wrong kind).
	ErrBadSegment = errors.New("bad segment")
	// ErrOutOfRange is returned for a copy outside its segment or the arena.
	ErrOutOfRange = errors.New("copy range out of bounds")
	// ErrClosed is returned after Close.
	ErrClosed = errors.New("closed")
	// ErrReplaced is returned by Rechecker.Recheck for a segment whose name
	// no longer names the object that was attached.
	ErrReplaced = errors.New("segment object replaced")
)

// Backend attaches engines' device memory and allocates host memory. It is
// safe for concurrent use.
type Backend interface {
	// Name is the backend's short name ("shm", "cuda").
	Name() string
	// AllocArena returns host memory of at least bytes for the pool.
	AllocArena(bytes int64) (Arena, error)
	// Attach opens an engine's segments, in spec order.
	Attach(engine string, segs []messages.Segment) (Attachment, error)
}

// Arena is the host pool's memory.
type Arena interface {
	// Bytes is the arena's memory; valid until Close.
	Bytes() []byte
	Close() error
}

// Attachment is one engine's attached segments (not a GPU: the node serves
// one GPU, and attaches each engine's segments on it). Copy may be called
// from several goroutines at once; copies of disjoint ranges do not
// interfere.
type Attachment interface {
	// SegmentSize is the size in bytes of segment i.
	SegmentSize(i int) int64
	// Copy performs every range in the direction given and returns when the
	// bytes have landed (or the first error).
	Copy(dir Direction, arena Arena, ranges []Range) error
	Close() error
}

// Object names the object behind one attached segment: the device and
// inode of a shm object. The zero Object is a segment with no such identity
// (a cuda_ipc handle).
type Object struct{ Dev, Ino uint64 }

// Objects is an Attachment that can tell which objects it attached. Names
// are checked at register, but an object's name may change after (a
// rename in the shm directory), so the node compares objects too: two live
// engines never map one object (docs/SECURITY.md).
type Objects interface {
	// Objects returns each segment's Object, in spec order; none after
	// Close.
	Objects() []Object
}

// Rechecker is an Attachment that can tell whether its segments' names
// still name the objects it attached. A restarted engine that recreates its
// shm object under the same name and registers an identical spec must not
// keep the node copying to and from the dead process's unlinked object; the
// node asks Recheck before it treats such a register as a no-op.
type Rechecker interface {
	// Recheck returns nil when every segment's name still names the object
	// attached, else an error wrapping ErrReplaced that says which segment
	// and how (missing, another object, no longer one link). It opens and
	// maps nothing: one stat per segment.
	Recheck() error
}
