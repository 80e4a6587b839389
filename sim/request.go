package sim

import (
	"fmt"
	"math/rand/v2"
)

// phase is where a request is in the simulated scheduler.
type phase uint8

const (
	queued    phase = iota // arrived, never scheduled
	running                // scheduled: holds blocks
	preempted              // preempted, waiting to resume; holds no blocks
	ended                  // finished or aborted
)

// chunkRef names one chunk of one request.
type chunkRef struct {
	group int
	index int
}

// request is one simulated sequence. Only the engine's goroutine touches it.
type request struct {
	id     string
	rng    *rand.Rand
	tokens []uint32 // prompt, then sampled tokens
	hashes []Hash   // every full hash block of tokens (published or not)
	prompt int
	output int // tokens to generate
	gen    int // tokens generated so far

	phase    phase
	computed int   // as the last tokens event (or resume) said: KV written and fenced
	inflight int   // computed once the in-flight forward pass completes
	written  []int // per group: leading blocks whose bytes are written (or null)
	blocks   [][]uint32
	pubHash  int // hashes published
	hit      int // tokens a resume finds in the local prefix cache

	queuedAbort bool // aborted while queued, abortStep steps after arrival
	abortStep   int
	abortAt     int // abort during prefill once computed reaches it (0: never)
	preemptAt   int // preempt on purpose once computed reaches it (0: never)

	// End state, for the final check.
	aborted     bool
	finalT      int
	finalHashes int
	finalBlocks [][]uint32
	stored      map[chunkRef]bool
	// nulled are chunks that had a null block at some point: kvactors may
	// rightly have passed them over for good (a cursor never goes back),
	// even if a later resume gave them real blocks.
	nulled map[chunkRef]bool

	// Releases: owed per reason, received per reason, and the block ids
	// each owed release will free (oldest first).
	expected map[string]int
	received map[string]int
	held     map[string][][][]uint32
	// owedOrder is the reasons of owed releases, oldest first.
	owedOrder []string
	// nodeLost: a release answered the final event as node_lost.
	nodeLost bool
}

// newRequest draws request i of the engine: lengths, prompt tokens (a
// shared prefix for some) and its fate, all from its own PRNG so that the
// same Seed gives the same requests whatever the timing.
func (e *engine) newRequest(i int) *request {
	c := &e.cfg
	rng := newRand(c.Seed, stringSeed(c.Engine), uint64(i))
	r := &request{
		id:       fmt.Sprintf("r%d", i),
		rng:      rng,
		prompt:   c.MinPromptTokens + rng.IntN(c.MaxPromptTokens-c.MinPromptTokens+1),
		output:   c.MinOutputTokens + rng.IntN(c.MaxOutputTokens-c.MinOutputTokens+1),
		written:  make([]int, len(c.Groups)),
		blocks:   make([][]uint32, len(c.Groups)),
		stored:   map[chunkRef]bool{},
		nulled:   map[chunkRef]bool{},
		expected: map[string]int{},
		received: map[string]int{},
		held:     map[string][][][]uint32{},
	}
	r.tokens = make([]uint32, 0, r.prompt+r.output)
	if len(e.prefixes) > 0 && rng.Float64() < c.SharedRatio {
		p := e.prefixes[rng.IntN(len(e.prefixes))]
		r.tokens = append(r.tokens, p[:min(len(p), r.prompt)]...)
	}
	for len(r.tokens) < r.prompt {
		r.tokens = append(r.tokens, sampleToken(rng))
	}
	r.hashes = appendHashes(nil, r.tokens, c.TokensPerHash)
	switch x := rng.Float64(); {
	case x < c.QueuedAbortRatio:
		r.queuedAbort = true
		r.abortStep = 1 + rng.IntN(3)
	case x < c.QueuedAbortRatio+c.MidAbortRatio && r.prompt > 1:
		r.abortAt = 1 + rng.IntN(r.prompt-1)
	}
	if !r.queuedAbort && rng.Float64() < c.PreemptRatio {
		r.preemptAt = 1 + rng.IntN(r.prompt+r.output-1)
	}
	return r
}

// sharedPrefixes are the prompt prefixes some requests start with. They
// depend only on Seed, not on the engine, so engines share them.
func sharedPrefixes(c *Config) [][]uint32 {
	out := make([][]uint32, c.SharedPrefixes)
	for p := range out {
		rng := newRand(c.Seed, stringSeed("shared-prefix"), uint64(p))
		out[p] = make([]uint32, c.SharedPrefixTokens)
		for i := range out[p] {
			out[p][i] = sampleToken(rng)
		}
	}
	return out
}

// sampleToken draws a token id from a Llama-sized vocabulary.
func sampleToken(rng *rand.Rand) uint32 { return uint32(rng.IntN(32000)) }

// sample appends one generated token (async scheduling knows it once the
// forward pass that produced it completed).
func (r *request) sample(tph int) {
	r.tokens = append(r.tokens, sampleToken(r.rng))
	r.gen++
	r.hashes = appendHashes(r.hashes, r.tokens, tph)
}

// hold moves the request's blocks aside until the release for reason
// arrives, and owes that release.
func (r *request) hold(reason string) {
	r.expected[reason]++
	r.owedOrder = append(r.owedOrder, reason)
	r.held[reason] = append(r.held[reason], r.blocks)
	r.blocks = make([][]uint32, len(r.blocks))
	for g := range r.written {
		r.written[g] = 0
	}
}

// readyChunks lists the chunks that were ready when the request finished
// (PROTOCOL.md "ready prefix" with the finished event's T): full chunks of
// T tokens whose hashes were published and whose blocks are tracked, last
// block not null.
func (r *request) readyChunks(c *Config) []chunkRef {
	var out []chunkRef
	for g, gc := range c.Groups {
		tpc := gc.TokensPerBlock * c.BlocksPerChunk
		hpc := tpc / c.TokensPerHash
		ids := r.finalBlocks[g]
		n := min(r.finalT/tpc, r.finalHashes/hpc, len(ids)/c.BlocksPerChunk)
		for i := range n {
			if ids[(i+1)*c.BlocksPerChunk-1] != 0 {
				out = append(out, chunkRef{g, i})
			}
		}
	}
	return out
}

// key is the offload key of chunk ch, in hex.
func (r *request) key(c *Config, ch chunkRef) (string, error) {
	bad := fmt.Errorf("chunk %d of group %d is beyond what request %s has", ch.index, ch.group, r.id)
	if ch.group < 0 || ch.group >= len(c.Groups) || ch.index < 0 {
		return "", bad
	}
	hpc := c.Groups[ch.group].TokensPerBlock * c.BlocksPerChunk / c.TokensPerHash
	i := (ch.index+1)*hpc - 1
	if i >= len(r.hashes) {
		return "", bad
	}
	return KeyHex(r.hashes[i], ch.group), nil
}
