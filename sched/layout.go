package sched

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/kvactors/kvactors/messages"
)

// Kind of a KV-cache group.
type Kind uint8

const (
	KindFull Kind = iota
	KindSlidingWindow
	KindEagle
)

func (k Kind) String() string {
	switch k {
	case KindSlidingWindow:
		return messages.KindSlidingWindow
	case KindEagle:
		return messages.KindEagle
	}
	return messages.KindFull
}

// GroupLayout is one group's geometry, derived once from its GroupSpec.
type GroupLayout struct {
	Kind           Kind
	TokensPerBlock int
	TokensPerChunk int // TokensPerBlock * BlocksPerChunk
	HashesPerChunk int // TokensPerChunk / TokensPerHash
	SlidingWindow  int
	Regions        []messages.Region
	BlockBytes     int64 // host bytes of one block: its regions' block_bytes summed
	ChunkBytes     int64 // BlockBytes * BlocksPerChunk: a chunk's bytes in the pool
	// MaxBlocks bounds a request's block ids in this group:
	// ceil(max_model_len / tokens_per_block).
	MaxBlocks int
}

// Layout is an engine's validated geometry. After NewLayout the core trusts
// it (raft's Config.validate habit): every limit below holds.
type Layout struct {
	TokensPerHash     int
	BlocksPerChunk    int
	NumGPUBlocks      int
	OffloadPromptOnly bool
	Groups            []GroupLayout
	// Namespace prefixes every key of this engine; the node sets it after
	// interning the spec's namespace (zero until then).
	Namespace NamespaceID
	// MaxHashes bounds a request's hashes: ceil(max_model_len / tph)
	// (PROTOCOL.md "Isolation", bounds).
	MaxHashes int
	// Budget, when set, bounds the bytes of hashes and block ids the
	// engine's live requests hold together; the node sets it, one per
	// engine id shared by its registers (nil: only each request's bounds).
	// Not geometry (SameGeometry and the namespace digest ignore it): it
	// rides here, the one thing every request of the engine points to,
	// because a pointer in each Request would push it past its size class
	// (TestStateSizes).
	Budget *StateBudget
}

// ErrBadLayout wraps every reason NewLayout rejects a spec.
var ErrBadLayout = errors.New("bad engine layout")

// NewLayout validates the scheduling-relevant part of spec. Whether regions
// lie inside their segments needs the segments' sizes and is checked by the
// caller after attaching them (see Layout.CheckSegments).
func NewLayout(spec *messages.EngineSpec) (*Layout, error) {
	bad := func(format string, a ...any) (*Layout, error) {
		return nil, fmt.Errorf("%w: "+format, append([]any{ErrBadLayout}, a...)...)
	}
	switch {
	case spec.TokensPerHash < 1:
		return bad("tokens_per_hash %d < 1", spec.TokensPerHash)
	case spec.BlocksPerChunk < 1:
		return bad("blocks_per_chunk %d < 1", spec.BlocksPerChunk)
	case spec.NumGPUBlocks < 1 || spec.NumGPUBlocks > 1<<31:
		return bad("num_gpu_blocks %d out of [1, 2^31]", spec.NumGPUBlocks)
	case len(spec.Groups) == 0:
		return bad("no groups")
	case spec.MaxModelLen < 0:
		return bad("max_model_len %d < 0", spec.MaxModelLen)
	}
	l := &Layout{TokensPerHash: spec.TokensPerHash, BlocksPerChunk: spec.BlocksPerChunk,
		NumGPUBlocks: spec.NumGPUBlocks, OffloadPromptOnly: spec.OffloadPromptOnly}
	for i, g := range spec.Groups {
		gl := GroupLayout{TokensPerBlock: g.TokensPerBlock, SlidingWindow: g.SlidingWindow,
			Regions: g.Regions}
		switch g.Kind {
		case messages.KindFull:
			gl.Kind = KindFull
		case messages.KindSlidingWindow:
			gl.Kind = KindSlidingWindow
			if g.SlidingWindow < 1 {
				return bad("group %d: sliding_window %d < 1", i, g.SlidingWindow)
			}
		case messages.KindEagle:
			gl.Kind = KindEagle
		default:
			return bad("group %d: unknown kind %q", i, g.Kind)
		}
		if g.TokensPerBlock < 1 {
			return bad("group %d: tokens_per_block %d < 1", i, g.TokensPerBlock)
		}
		gl.TokensPerChunk = g.TokensPerBlock * spec.BlocksPerChunk
		if gl.TokensPerChunk%spec.TokensPerHash != 0 {
			return bad("group %d: tokens_per_chunk %d is not a multiple of tokens_per_hash %d",
				i, gl.TokensPerChunk, spec.TokensPerHash)
		}
		gl.HashesPerChunk = gl.TokensPerChunk / spec.TokensPerHash
		if len(g.Regions) == 0 {
			return bad("group %d: no regions", i)
		}
		for j, r := range g.Regions {
			if r.Segment < 0 || r.Segment >= len(spec.Segments) {
				return bad("group %d region %d: segment %d out of range", i, j, r.Segment)
			}
			if r.Offset < 0 || r.BlockBytes < 1 || r.BlockStride < r.BlockBytes {
				return bad("group %d region %d: need offset >= 0, block_bytes >= 1, block_stride >= block_bytes", i, j)
			}
			if gl.BlockBytes > math.MaxInt64-r.BlockBytes {
				return bad("group %d: block_bytes over its regions overflow", i)
			}
			gl.BlockBytes += r.BlockBytes
		}
		// A wrapped (negative) chunk size would pass every "fits" check.
		if gl.BlockBytes > math.MaxInt64/int64(spec.BlocksPerChunk) {
			return bad("group %d: chunk bytes (block_bytes %d × blocks_per_chunk %d) overflow", i, gl.BlockBytes,
				spec.BlocksPerChunk)
		}
		gl.ChunkBytes = gl.BlockBytes * int64(spec.BlocksPerChunk)
		l.Groups = append(l.Groups, gl)
	}
	mml := int64(spec.MaxModelLen)
	if mml == 0 {
		for _, g := range l.Groups {
			mml = max(mml, int64(spec.NumGPUBlocks)*int64(g.TokensPerBlock))
		}
	}
	l.MaxHashes = ceilDiv(mml, spec.TokensPerHash)
	for i := range l.Groups {
		l.Groups[i].MaxBlocks = ceilDiv(mml, l.Groups[i].TokensPerBlock)
	}
	return l, nil
}

// CapModelLen lowers the layout's bounds (MaxHashes, each group's
// MaxBlocks) to those of a max_model_len of tokens, when that is lower: a
// node's own bound on what one request may hold (--max-model-len). Only
// before the layout is in use.
func (l *Layout) CapModelLen(tokens int64) {
	if tokens < 0 {
		return
	}
	l.MaxHashes = min(l.MaxHashes, ceilDiv(tokens, l.TokensPerHash))
	for i := range l.Groups {
		l.Groups[i].MaxBlocks = min(l.Groups[i].MaxBlocks, ceilDiv(tokens, l.Groups[i].TokensPerBlock))
	}
}

// ceilDiv is ceil(a/b) for a >= 0, b >= 1 (no overflow near MaxInt64),
// capped at MaxInt32: a larger bound holds nothing back anyway, and the cap
// keeps Start+len arithmetic far from overflow.
func ceilDiv(a int64, b int) int {
	q := a / int64(b)
	if a%int64(b) != 0 {
		q++
	}
	return int(min(q, math.MaxInt32))
}

// SameGeometry reports whether o stores chunks exactly as l does: the same
// tokens per hash, blocks per chunk, and per group the same kind, tokens per
// block and bytes per block per region. Engines that share a namespace must
// (PROTOCOL.md "Isolation"): a key names the same bytes for all of them.
func (l *Layout) SameGeometry(o *Layout) error {
	switch {
	case l.TokensPerHash != o.TokensPerHash:
		return fmt.Errorf("tokens_per_hash %d, the namespace holds %d", o.TokensPerHash, l.TokensPerHash)
	case l.BlocksPerChunk != o.BlocksPerChunk:
		return fmt.Errorf("blocks_per_chunk %d, the namespace holds %d", o.BlocksPerChunk, l.BlocksPerChunk)
	case len(l.Groups) != len(o.Groups):
		return fmt.Errorf("%d groups, the namespace holds %d", len(o.Groups), len(l.Groups))
	}
	for g := range l.Groups {
		a, b := &l.Groups[g], &o.Groups[g]
		switch {
		case a.Kind != b.Kind:
			return fmt.Errorf("group %d: kind %s, the namespace holds %s", g, b.Kind, a.Kind)
		case a.TokensPerBlock != b.TokensPerBlock:
			return fmt.Errorf("group %d: tokens_per_block %d, the namespace holds %d", g, b.TokensPerBlock, a.TokensPerBlock)
		case len(a.Regions) != len(b.Regions):
			return fmt.Errorf("group %d: %d regions, the namespace holds %d", g, len(b.Regions), len(a.Regions))
		}
		for r := range a.Regions {
			if a.Regions[r].BlockBytes != b.Regions[r].BlockBytes {
				return fmt.Errorf("group %d region %d: block_bytes %d, the namespace holds %d",
					g, r, b.Regions[r].BlockBytes, a.Regions[r].BlockBytes)
			}
		}
	}
	return nil
}

// ChunkSizes is each group's chunk bytes, in group order.
func (l *Layout) ChunkSizes() []int64 {
	sizes := make([]int64, len(l.Groups))
	for i, g := range l.Groups {
		sizes[i] = g.ChunkBytes
	}
	return sizes
}

// MaxChunkBytes is the largest chunk of any group (register refuses an
// engine whose largest chunk does not fit in the pool).
func (l *Layout) MaxChunkBytes() int64 {
	var m int64
	for _, g := range l.Groups {
		m = max(m, g.ChunkBytes)
	}
	return m
}

// CheckSegments verifies that every region's last block lies inside its
// segment, given the attached segments' sizes.
func (l *Layout) CheckSegments(segSize func(i int) int64) error {
	last := int64(l.NumGPUBlocks - 1)
	for gi, g := range l.Groups {
		for ri, r := range g.Regions {
			// offset + last*stride + bytes must not overflow: a wrapped product
			// can land inside the segment (NewLayout made all three >= 0).
			if last > 0 && r.BlockStride > (math.MaxInt64-r.Offset-r.BlockBytes)/last {
				return fmt.Errorf("%w: group %d region %d: block %d at stride %d overflows int64",
					ErrBadLayout, gi, ri, last, r.BlockStride)
			}
			end := r.Offset + last*r.BlockStride + r.BlockBytes
			if size := segSize(r.Segment); end > size || end < r.Offset {
				return fmt.Errorf("%w: group %d region %d: block %d ends at byte %d, past segment %d (%d bytes)",
					ErrBadLayout, gi, ri, last, end, r.Segment, size)
			}
		}
	}
	return nil
}

// Span is the bytes [Off, End) of one segment that an engine's regions use.
type Span struct {
	Off, End int64
}

// Spans returns, for each of the spec's segments segments, the span its
// regions use: from the lowest region offset to the highest end of a
// region's last block (num_gpu_blocks - 1). The node maps only that much of
// each segment (docs/SECURITY.md), so a segment no region uses is refused:
// mapping it would serve nothing. Overflowing offset arithmetic is refused
// as in CheckSegments. Errors wrap ErrBadLayout.
func (l *Layout) Spans(segments int) ([]Span, error) {
	spans := make([]Span, segments)
	used := make([]bool, segments)
	last := int64(l.NumGPUBlocks - 1)
	for gi, g := range l.Groups {
		for ri, r := range g.Regions {
			if r.Segment < 0 || r.Segment >= segments {
				return nil, fmt.Errorf("%w: group %d region %d: segment %d out of range", ErrBadLayout, gi, ri, r.Segment)
			}
			// offset + last*stride + bytes must not overflow (NewLayout made
			// all three >= 0, bytes >= 1).
			if r.Offset > math.MaxInt64-r.BlockBytes ||
				(last > 0 && r.BlockStride > (math.MaxInt64-r.Offset-r.BlockBytes)/last) {
				return nil, fmt.Errorf("%w: group %d region %d: block %d at stride %d overflows int64",
					ErrBadLayout, gi, ri, last, r.BlockStride)
			}
			span := Span{Off: r.Offset, End: r.Offset + last*r.BlockStride + r.BlockBytes}
			if s := &spans[r.Segment]; !used[r.Segment] {
				*s, used[r.Segment] = span, true
			} else {
				s.Off, s.End = min(s.Off, span.Off), max(s.End, span.End)
			}
		}
	}
	for i, u := range used {
		if !u {
			return nil, fmt.Errorf("%w: segment %d: no region uses it", ErrBadLayout, i)
		}
	}
	return spans, nil
}

// The pool key's encoding lives here and only here: AppendKey builds it,
// SplitKey and WireKey take it apart.
//
// NamespaceID is a node's small number for a namespace (PROTOCOL.md
// "Isolation"): the node interns each namespace name once and every pool key
// starts with it, so dedup, lookup, load and eviction never cross
// namespaces while the pool sees keys as opaque strings. On the wire
// (P.E.stored, kv_events) a key is the protocol's offload key, without it.
type NamespaceID uint32

// keyNSBytes and keyGroupBytes are the lengths of a key's namespace prefix
// and group suffix.
const (
	keyNSBytes    = 4
	keyGroupBytes = 4
)

// AppendKey appends the pool key of a chunk to b: the namespace id (4
// big-endian bytes), then the offload key, i.e. the chunk's last block hash
// followed by the group index as 4 big-endian bytes (PROTOCOL.md, "offload
// key").
func AppendKey(b []byte, ns NamespaceID, last messages.Hash, group int) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(ns))
	b = append(b, last...)
	return binary.BigEndian.AppendUint32(b, uint32(group))
}

// Key is the pool key of a chunk (AppendKey).
func Key(ns NamespaceID, last messages.Hash, group int) messages.Key {
	return messages.Key(AppendKey(make([]byte, 0, keyNSBytes+len(last)+keyGroupBytes), ns, last, group))
}

// Key is the pool key of a chunk in this layout's namespace.
func (l *Layout) Key(last messages.Hash, group int) messages.Key {
	return Key(l.Namespace, last, group)
}

// SplitKey is Key's inverse: the namespace id, the block hash and the group
// index. A key too short for both (never built by Key) splits into
// namespace 0, the whole key as hash, group 0.
func SplitKey(k messages.Key) (NamespaceID, messages.Hash, int) {
	if len(k) < keyNSBytes+keyGroupBytes {
		return 0, messages.Hash(k), 0
	}
	n := len(k) - keyGroupBytes
	return NamespaceID(binary.BigEndian.Uint32([]byte(k[:keyNSBytes]))), messages.Hash(k[keyNSBytes:n]),
		int(binary.BigEndian.Uint32([]byte(k[n:])))
}

// WireKey is the offload key as the protocol shows it (P.E.stored "key"):
// hash and group, without the node-local namespace prefix.
func WireKey(k messages.Key) messages.Key {
	if len(k) < keyNSBytes+keyGroupBytes {
		return k
	}
	return k[keyNSBytes:]
}
