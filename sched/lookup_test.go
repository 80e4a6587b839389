package sched

import (
	"fmt"
	"math/rand"
	"reflect"
	"testing"
	"testing/quick"

	"github.com/stretchr/testify/require"

	"github.com/kvactors/kvactors/messages"
)

// naiveHitTokens is HitTokens as it was first written, the oracle of
// TestHitTokensIsNaive: PROTOCOL.md "lookup" for the full groups, then
// kvactors' rule for the other kinds (docs/PROTOCOL.md, "lookup") checked
// from scratch at every step down, O(N·k) ready calls.
func naiveHitTokens(l *Layout, hashes []messages.Hash, ready func(messages.Key) bool) int {
	hit, step := -1, 0
	for g, gl := range l.Groups {
		if gl.Kind != KindFull {
			continue
		}
		n := 0
		for ; (n+1)*gl.HashesPerChunk <= len(hashes); n++ {
			if !ready(l.Key(hashes[(n+1)*gl.HashesPerChunk-1], g)) {
				break
			}
		}
		if t := n * gl.TokensPerChunk; hit < 0 || t < hit {
			hit = t
		}
		step = max(step, gl.TokensPerChunk)
	}
	if hit <= 0 {
		return 0
	}
	for ; hit > 0; hit -= min(step, hit) {
		if naiveOthersBack(l, hit, hashes, ready) {
			return hit
		}
	}
	return 0
}

func naiveOthersBack(l *Layout, t int, hashes []messages.Hash, ready func(messages.Key) bool) bool {
	for g, gl := range l.Groups {
		if gl.Kind == KindFull {
			continue
		}
		end := t / gl.TokensPerChunk
		first := 0
		if gl.Kind == KindSlidingWindow {
			first = max(0, t-gl.SlidingWindow) / gl.TokensPerChunk
		}
		for c := first; c < end; c++ {
			i := (c+1)*gl.HashesPerChunk - 1
			if i >= len(hashes) || !ready(l.Key(hashes[i], g)) {
				return false
			}
		}
	}
	return true
}

// lookupCase is a random layout, hash list and set of ready keys. Hashes
// come from a small alphabet, so keys repeat along the list (the hostile
// shape of TestHitTokensAsksEachChunkOnce, and others).
type lookupCase struct {
	spec   messages.EngineSpec
	hashes []messages.Hash
	ready  map[messages.Key]bool
}

func (lookupCase) Generate(rnd *rand.Rand, _ int) reflect.Value {
	tph := []int{1, 2, 4}[rnd.Intn(3)]
	c := lookupCase{spec: messages.EngineSpec{TokensPerHash: tph, BlocksPerChunk: 1 + rnd.Intn(3), NumGPUBlocks: 64,
		Segments: []messages.Segment{{Shm: "s"}}}, ready: map[messages.Key]bool{}}
	for range 1 + rnd.Intn(4) {
		g := messages.GroupSpec{Kind: []string{messages.KindFull, messages.KindSlidingWindow, messages.KindEagle}[rnd.Intn(3)],
			TokensPerBlock: tph * (1 + rnd.Intn(3)), Regions: []messages.Region{{BlockStride: 8, BlockBytes: 8}}}
		if g.Kind == messages.KindSlidingWindow {
			g.SlidingWindow = 1 + rnd.Intn(40)
			if rnd.Intn(4) == 0 {
				g.SlidingWindow = 1 << 30 // wider than any hit: every chunk below it
			}
		}
		c.spec.Groups = append(c.spec.Groups, g)
	}
	alphabet := 1 + rnd.Intn(6)
	c.hashes = make([]messages.Hash, rnd.Intn(60))
	for i := range c.hashes {
		c.hashes[i] = messages.Hash(fmt.Sprintf("h%d", rnd.Intn(alphabet)))
	}
	p := rnd.Float64()
	for h := range alphabet {
		for g := range c.spec.Groups {
			if rnd.Float64() < p {
				c.ready[Key(0, messages.Hash(fmt.Sprintf("h%d", h)), g)] = true
			}
		}
	}
	return reflect.ValueOf(c)
}

// TestHitTokensIsNaive: HitTokens, which asks about each chunk at most once,
// answers what the naive rule (PROTOCOL.md "lookup", kvactors' rule for the
// other kinds) answers, over random layouts, hash lists and ready sets.
func TestHitTokensIsNaive(t *testing.T) {
	f := func(c lookupCase) bool {
		l, err := NewLayout(&c.spec)
		require.NoError(t, err)
		ready := func(k messages.Key) bool { return c.ready[k] }
		got, want := l.HitTokens(c.hashes, ready), naiveHitTokens(l, c.hashes, ready)
		if got != want {
			t.Logf("groups %+v, hashes %v, ready %v: hit %d, naive %d", l.Groups, c.hashes, c.ready, got, want)
		}
		return got == want
	}
	require.NoError(t, quick.Check(f, &quick.Config{MaxCount: 20000}))
}

// TestHitTokensAsksEachChunkOnce: a lookup is O(len(hashes)) ready calls
// (each takes the pool's lock, on the engine's intake shard), however far
// the hit steps down. The hostile shape: tokens_per_hash 1, one block a
// chunk; (aa,0), (bb,0) and (aa,1) stored; hashes aa×k then bb×(n-k). Every
// full-group chunk is ready, so the hit starts at n and steps down n-k times,
// each step once needing all of [0, k) of group 1 by the naive rule.
func TestHitTokensAsksEachChunkOnce(t *testing.T) {
	const n, k = 4000, 2000
	hashes := make([]messages.Hash, n)
	for i := range hashes {
		hashes[i] = "bb"
		if i < k {
			hashes[i] = "aa"
		}
	}
	for name, other := range map[string]messages.GroupSpec{
		"eagle":          {Kind: messages.KindEagle, TokensPerBlock: 1},
		"sliding_window": {Kind: messages.KindSlidingWindow, TokensPerBlock: 1, SlidingWindow: 1 << 30},
	} {
		t.Run(name, func(t *testing.T) {
			full := messages.GroupSpec{Kind: messages.KindFull, TokensPerBlock: 1}
			for _, g := range []*messages.GroupSpec{&full, &other} {
				g.Regions = []messages.Region{{BlockStride: 8, BlockBytes: 8}}
			}
			l, err := NewLayout(&messages.EngineSpec{TokensPerHash: 1, BlocksPerChunk: 1, NumGPUBlocks: 64,
				Segments: []messages.Segment{{Shm: "s"}}, Groups: []messages.GroupSpec{full, other}})
			require.NoError(t, err)
			stored := map[messages.Key]bool{Key(0, "aa", 0): true, Key(0, "bb", 0): true, Key(0, "aa", 1): true}
			calls := 0
			hit := l.HitTokens(hashes, func(key messages.Key) bool { calls++; return stored[key] })
			require.Equal(t, k, hit, "group 1 backs only [0, k)")
			require.LessOrEqual(t, calls, len(l.Groups)*len(hashes)+2,
				"ready calls for %d hashes: a lookup must ask about each chunk of each group at most once", n)
		})
	}
}
