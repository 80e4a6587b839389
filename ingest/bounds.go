package ingest

import (
	"math"

	"github.com/kvactors/kvactors/messages"
)

// RequestBounds is what one request of spec may hold (PROTOCOL.md
// "Bounds"): ceil(max_model_len / tokens_per_hash) hashes and, in group g,
// ceil(max_model_len / tokens_per_block[g]) block ids, where an absent
// max_model_len is num_gpu_blocks × the largest tokens_per_block. Both are
// capped at MaxInt32: a larger bound holds nothing back, and the cap keeps
// start+len arithmetic far from overflow. The node may hold less (its
// --max-model-len caps an absent max_model_len); past these, it certainly
// rejects an event too_large. For a spec whose tokens_per_hash and
// tokens_per_block are ≥ 1 (DecodeSpec's); otherwise zero bounds.
func RequestBounds(spec *messages.EngineSpec) (hashes int, blocks []int) {
	if spec.TokensPerHash < 1 {
		return 0, make([]int, len(spec.Groups))
	}
	mml := int64(spec.MaxModelLen)
	if mml <= 0 {
		for _, g := range spec.Groups {
			mml = max(mml, int64(spec.NumGPUBlocks)*int64(g.TokensPerBlock))
		}
	}
	blocks = make([]int, len(spec.Groups))
	for i, g := range spec.Groups {
		if g.TokensPerBlock >= 1 {
			blocks[i] = ceilDiv(mml, g.TokensPerBlock)
		}
	}
	return ceilDiv(mml, spec.TokensPerHash), blocks
}

// ceilDiv is ceil(a/b) for a ≥ 0, b ≥ 1 (no overflow near MaxInt64),
// capped at MaxInt32.
func ceilDiv(a int64, b int) int {
	q := a / int64(b)
	if a%int64(b) != 0 {
		q++
	}
	return int(min(q, math.MaxInt32))
}
