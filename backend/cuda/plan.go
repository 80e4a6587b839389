package cuda

import (
	"encoding/hex"
	"fmt"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/messages"
)

// ipcHandleSize is CU_IPC_HANDLE_SIZE: a CUipcMemHandle is 64 opaque bytes.
const ipcHandleSize = 64

// ipcSegment is one engine segment as parsed from its spec.
type ipcSegment struct {
	handle [ipcHandleSize]byte
	bytes  int64
}

// parseSegments checks that every segment is a CUDA IPC allocation on device
// with a positive size and decodes its handle. Anything else (an shm segment,
// another device, a malformed handle) wraps backend.ErrBadSegment: this
// backend cannot reach it, whatever the engine meant.
func parseSegments(device int, segs []messages.Segment) ([]ipcSegment, error) {
	if len(segs) == 0 {
		return nil, fmt.Errorf("no segments: %w", backend.ErrBadSegment)
	}
	out := make([]ipcSegment, len(segs))
	for i, s := range segs {
		switch {
		case s.Shm != "":
			return nil, fmt.Errorf("segment %d is shm %q, which needs the shm backend: %w", i, s.Shm, backend.ErrBadSegment)
		case s.CUDAIPC == "":
			return nil, fmt.Errorf("segment %d has no cuda_ipc handle: %w", i, backend.ErrBadSegment)
		case s.Device != device:
			return nil, fmt.Errorf("segment %d is on device %d, this backend serves device %d: %w", i, s.Device, device, backend.ErrBadSegment)
		case s.Bytes <= 0:
			return nil, fmt.Errorf("segment %d: bytes %d, must be > 0: %w", i, s.Bytes, backend.ErrBadSegment)
		case len(s.CUDAIPC) != 2*ipcHandleSize:
			return nil, fmt.Errorf("segment %d: cuda_ipc is %d hex digits, want %d: %w", i, len(s.CUDAIPC), 2*ipcHandleSize, backend.ErrBadSegment)
		}
		if _, err := hex.Decode(out[i].handle[:], []byte(s.CUDAIPC)); err != nil {
			return nil, fmt.Errorf("segment %d: cuda_ipc: %w: %w", i, err, backend.ErrBadSegment)
		}
		out[i].bytes = s.Bytes
	}
	return out, nil
}

// plan checks every range against its segment and the arena, drops empty
// ones, and merges neighbours: a range that starts where the previous one
// ended in both device and host memory extends it. DMA reaches full
// bandwidth only with ranges of about 0.5-2 MB, and a chunk of a layout whose
// block regions sit back to back on the device (one region per group, or
// layers interleaved per block) then becomes a single copy. Callers list a
// chunk's ranges in pool order, so merging follows list order and never
// reorders: overlapping destinations keep their last-writer-wins order.
func plan(ranges []backend.Range, segSize []int64, arenaLen int64) ([]backend.Range, error) {
	out := make([]backend.Range, 0, len(ranges))
	for i, r := range ranges {
		if r.Segment < 0 || r.Segment >= len(segSize) {
			return nil, fmt.Errorf("cuda: range %d: segment %d of %d: %w", i, r.Segment, len(segSize), backend.ErrOutOfRange)
		}
		if !inside(r.SegOffset, r.Len, segSize[r.Segment]) {
			return nil, fmt.Errorf("cuda: range %d: [%d, +%d) outside segment %d of %d bytes: %w",
				i, r.SegOffset, r.Len, r.Segment, segSize[r.Segment], backend.ErrOutOfRange)
		}
		if !inside(r.PoolOff, r.Len, arenaLen) {
			return nil, fmt.Errorf("cuda: range %d: pool [%d, +%d) outside the %d-byte arena: %w",
				i, r.PoolOff, r.Len, arenaLen, backend.ErrOutOfRange)
		}
		if r.Len == 0 {
			continue
		}
		if n := len(out); n > 0 {
			last := &out[n-1]
			if last.Segment == r.Segment && last.SegOffset+last.Len == r.SegOffset && last.PoolOff+last.Len == r.PoolOff {
				last.Len += r.Len
				continue
			}
		}
		out = append(out, r)
	}
	return out, nil
}

// inside reports whether [off, off+n) lies in [0, size), without overflow.
func inside(off, n, size int64) bool {
	return off >= 0 && n >= 0 && off <= size && n <= size-off
}
