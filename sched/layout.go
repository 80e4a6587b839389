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
	ChunkBytes     int64 // BlockBytes * BlocksPerChunk: one pool slot's worth
}

// Layout is an engine's validated geometry. After NewLayout the core trusts
// it (raft's Config.validate habit): every limit below holds.
type Layout struct {
	TokensPerHash     int
	BlocksPerChunk    int
	NumGPUBlocks      int
	OffloadPromptOnly bool
	Groups            []GroupLayout
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
			gl.BlockBytes += r.BlockBytes
		}
		gl.ChunkBytes = gl.BlockBytes * int64(spec.BlocksPerChunk)
		l.Groups = append(l.Groups, gl)
	}
	return l, nil
}

// MaxChunkBytes is the largest chunk of any group: the pool slot size this
// engine needs.
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

// The offload key's encoding lives here and only here: AppendKey builds it,
// SplitKey and KeyHashHex take it apart.

// keyGroupBytes is the length of the group suffix of a key.
const keyGroupBytes = 4

// AppendKey appends the offload key of a chunk to b: the chunk's last block
// hash followed by the group index as 4 big-endian bytes (PROTOCOL.md,
// "offload key").
func AppendKey(b []byte, last messages.Hash, group int) []byte {
	b = append(b, last...)
	return binary.BigEndian.AppendUint32(b, uint32(group))
}

// Key is the offload key of a chunk (AppendKey).
func Key(last messages.Hash, group int) messages.Key {
	return messages.Key(AppendKey(make([]byte, 0, len(last)+keyGroupBytes), last, group))
}

// SplitKey is Key's inverse: the block hash and the group index.
func SplitKey(k messages.Key) (messages.Hash, int) {
	if len(k) < keyGroupBytes {
		return messages.Hash(k), 0
	}
	n := len(k) - keyGroupBytes
	return messages.Hash(k[:n]), int(binary.BigEndian.Uint32([]byte(k[n:])))
}

// KeyHashHex is the hex of a key's block hash, given the key's hex (the hash
// is the key's prefix, so a chunk needs only one hex encoding).
func KeyHashHex(keyHex string) string {
	if len(keyHex) < 2*keyGroupBytes {
		return keyHex
	}
	return keyHex[:len(keyHex)-2*keyGroupBytes]
}
