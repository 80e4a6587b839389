package backend

import (
	"math"

	"github.com/kvactors/kvactors/messages"
)

// Span is the part of one segment an engine's regions use: bytes
// [Off, End) of the segment, 0 <= Off < End.
type Span struct {
	Off, End int64
}

// Pages widens s to whole pages of page bytes (a power of two): what a
// mapping of it takes. ok is false when the rounded end would overflow.
func (s Span) Pages(page int64) (Span, bool) {
	if s.End > math.MaxInt64-(page-1) {
		return Span{}, false
	}
	return Span{Off: s.Off &^ (page - 1), End: (s.End + page - 1) &^ (page - 1)}, true
}

// Len is the span's length in bytes.
func (s Span) Len() int64 { return s.End - s.Off }

// SpanAttacher is a Backend that maps only the span of each segment the
// engine's regions use (the shm backend), so a sparse object of terabytes
// with a small region costs the node only that region's pages of address
// space (docs/SECURITY.md). The node uses it when its backend has it, and
// Attach otherwise (the cuda backend, whose segments are device allocations
// the driver maps whole). Ranges stay offsets in the whole segment; a copy
// outside the span is ErrOutOfRange, and SegmentSize is still the size of
// the whole segment.
type SpanAttacher interface {
	// AttachSpans is Attach with spans[i] the part of segs[i] to map:
	// len(spans) == len(segs). A span past the end of its segment wraps
	// ErrBadSegment, and nothing stays mapped.
	AttachSpans(engine string, segs []messages.Segment, spans []Span) (Attachment, error)
}
