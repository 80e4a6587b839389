package bench

import (
	"math/rand/v2"
	"strconv"

	"github.com/kvactors/kvactors/messages"
)

// geometry is one simulated engine's KV-cache layout: every group has the
// same tokens per block (as in vLLM's hybrid allocator) and one region.
type geometry struct {
	tph, tpb, bpc int
	kinds         []string // one per group
	window        int      // sliding_window groups' window, in tokens
	blockBytes    int64
	numBlocks     int
}

func (g geometry) groups() int         { return len(g.kinds) }
func (g geometry) tokensPerChunk() int { return g.tpb * g.bpc }
func (g geometry) hashesPerChunk() int { return g.tokensPerChunk() / g.tph }
func (g geometry) segmentBytes() int64 { return int64(g.groups()) * int64(g.numBlocks) * g.blockBytes }

// benchNamespace is shared by the generated engines: their requests share a
// system prompt, and its chunks deduplicate across engines only within one
// namespace (PROTOCOL.md "Isolation").
const benchNamespace = "kvactors-bench"

// spec is the EngineSpec of an engine with this geometry in segment shm.
func (g geometry) spec(shm string) messages.EngineSpec {
	s := messages.EngineSpec{TokensPerHash: g.tph, BlocksPerChunk: g.bpc, NumGPUBlocks: g.numBlocks,
		Segments: []messages.Segment{{Shm: shm}}, Namespace: benchNamespace}
	for i, kind := range g.kinds {
		gs := messages.GroupSpec{Kind: kind, TokensPerBlock: g.tpb, Regions: []messages.Region{{
			Offset: int64(i) * int64(g.numBlocks) * g.blockBytes, BlockStride: g.blockBytes, BlockBytes: g.blockBytes}}}
		if kind == messages.KindSlidingWindow {
			gs.SlidingWindow = g.window
		}
		s.Groups = append(s.Groups, gs)
	}
	return s
}

// eventGeometry is the throughput, latency and scale phases' engine: a
// hybrid model (full attention plus sliding window), 16 tokens per block and
// per hash, 4 blocks per chunk, small blocks so the copies stay cheap and
// the phases measure event handling.
func eventGeometry() geometry {
	return geometry{tph: 16, tpb: 16, bpc: 4, kinds: []string{messages.KindFull, messages.KindSlidingWindow},
		window: 1024, blockBytes: 256, numBlocks: 8192}
}

// eventPoolBytes is the pool of the event phases: 16,384 slots of one
// 1 KiB chunk, small enough that runs reach the steady state of a full
// pool evicting its least recently used chunks.
const eventPoolBytes = 16 << 20

// workload shapes the requests of one generated engine.
type workload struct {
	promptMin, promptMax int     // prompt tokens, uniform
	outputMin, outputMax int     // decoded tokens, uniform
	prefillChunk         int     // tokens per prefill step (chunked prefill)
	running              int     // requests scheduled per engine at once
	queuedAbort          float64 // fraction aborted before any block
	midAbort             float64 // fraction aborted during prefill
	shared               float64 // fraction starting with a shared prefix
	families             int     // distinct shared prefixes
	sharedHashes         int     // hashes in a shared prefix
	noHashes             bool    // publish no hashes: no chunk is ever ready, nothing is stored
}

// mixedWorkload is the throughput phase's mix: requests arrive, prefill in
// 512-token steps, decode 0..128 tokens and finish; some abort; a quarter
// share a system prompt, so dedup happens.
func mixedWorkload() workload {
	return workload{promptMin: 128, promptMax: 2048, outputMin: 0, outputMax: 128, prefillChunk: 512,
		running: 32, queuedAbort: 0.03, midAbort: 0.05, shared: 0.25, families: 8, sharedHashes: 32}
}

// genReq is one generated request. Per vLLM with async scheduling, a step's
// blocks are published when it is scheduled (ahead of its tokens), its
// tokens one turn later, once the forward pass finished, and the hashes of
// those tokens one turn after that.
type genReq struct {
	id        string
	seed      uint64 // hash content
	family    int    // shared prefix, -1 for none
	prompt    int
	target    int // tokens at which it finishes
	scheduled int // tokens the current step computes (blocks cover them)
	computed  int // tokens reported computed
	blocks    int // blocks published, per group
	hashes    int // hashes published
	turn      int
	abortAt   int // turn that aborts: -1 never, 0 queued abort
	ready     int // chunks per group ready so far (latency attribution)
}

// triggers records, for latency attribution, the batch after which each
// chunk of each request became ready: per request, indexed by chunk (a
// chunk's groups become ready together). One slice per request, not a map
// entry per chunk: the table is live through a level, and a pointer per
// chunk made the bench's own collections (and its tail) grow with it.
type triggers map[string][]int32

// record notes that request's chunks [from, to) became ready after batch.
func (t triggers) record(request string, from, to, batch int) {
	s := t[request]
	for len(s) < to {
		s = append(s, -1)
	}
	for c := from; c < to; c++ {
		s[c] = int32(batch)
	}
	t[request] = s
}

// of is the batch that made st's last chunk ready, or -1 when a chunk is
// not in the table (a stored message this run did not cause).
func (t triggers) of(st *messages.Stored) int {
	s, trigger := t[st.Request], -1
	for _, ch := range st.Chunks {
		if ch.Index < 0 || ch.Index >= len(s) || s[ch.Index] < 0 {
			return -1
		}
		trigger = max(trigger, int(s[ch.Index]))
	}
	return trigger
}

// engineGen generates one engine's batches in order.
type engineGen struct {
	id     string
	geo    geometry
	w      workload
	rng    *rand.Rand
	tag    string // phase tag in request ids: ids are unique per run
	seed   uint64
	epoch  string
	seq    uint64
	reqs   uint64   // requests created
	blocks []uint32 // next block id per group
	run    []*genReq
	cursor int
	enc    encoder
	idBuf  []uint32
	// trigger, when set, records for each chunk the index of the batch
	// after which it is ready (latency attribution); batches counts them.
	trigger triggers
	batches int
}

func newEngineGen(id, tag string, seed uint64, geo geometry, w workload) *engineGen {
	return &engineGen{id: id, geo: geo, w: w, rng: rand.New(rand.NewPCG(seed, 0x6b76)), tag: tag, seed: seed,
		epoch: "bench-" + tag, blocks: make([]uint32, geo.groups())}
}

// next builds the next batch: requests take turns (one step each) until the
// batch holds about target events, at most 64, or every running request
// took its turn. New requests are admitted while fewer than w.running run.
func (g *engineGen) next(target int) batch {
	const maxEvents = 64
	perTurn := 2 + g.geo.groups() // the most events one turn emits
	g.seq++
	g.enc.begin(g.epoch, g.seq)
	for visited := 0; g.enc.b.Events() < target && g.enc.b.Events()+perTurn <= maxEvents; visited++ {
		if len(g.run) < g.w.running {
			g.run = append(g.run, g.newRequest())
		}
		if visited >= len(g.run) || len(g.run) == 0 {
			break
		}
		g.cursor %= len(g.run)
		r := g.run[g.cursor]
		if g.turn(r) {
			g.run = append(g.run[:g.cursor], g.run[g.cursor+1:]...)
		} else {
			g.cursor++
		}
	}
	b := g.enc.finish()
	g.batches++
	return b
}

func (g *engineGen) newRequest() *genReq {
	g.reqs++
	w := &g.w
	r := &genReq{id: "cmpl-" + g.tag + "-" + g.id + "-" + strconv.FormatUint(g.reqs, 10), family: -1, abortAt: -1,
		seed: splitmix64(g.seed ^ g.reqs<<20)}
	r.prompt = w.promptMin + g.rng.IntN(w.promptMax-w.promptMin+1)
	r.target = r.prompt + w.outputMin + g.rng.IntN(w.outputMax-w.outputMin+1)
	if w.shared > 0 && g.rng.Float64() < w.shared {
		r.family = g.rng.IntN(w.families)
	}
	switch p := g.rng.Float64(); {
	case p < w.queuedAbort:
		r.abortAt = 0
	case p < w.queuedAbort+w.midAbort:
		r.abortAt = 1 + g.rng.IntN(max(1, r.prompt/w.prefillChunk))
	}
	return r
}

// hash is request r's hash i: a shared prefix's hashes are the family's.
func (g *engineGen) hash(r *genReq) func(i int, dst *[hashBytes]byte) {
	return func(i int, dst *[hashBytes]byte) {
		if r.family >= 0 && i < g.w.sharedHashes {
			fillHash(0xfa11+uint64(r.family), i, dst)
			return
		}
		fillHash(r.seed, i, dst)
	}
}

// turn emits one step of r and reports whether r ended.
func (g *engineGen) turn(r *genReq) bool {
	e := &g.enc
	defer func() { r.turn++ }()
	if r.turn == 0 {
		e.added(r.id, r.prompt)
		if r.abortAt == 0 {
			e.finished(r.id, true, 0, r.prompt)
			return true
		}
		g.schedule(r, min(r.prompt, g.w.prefillChunk))
		return false
	}
	lagging := r.computed / g.geo.tph // hashes of the tokens reported last turn
	r.computed = r.scheduled
	switch {
	case r.turn == r.abortAt:
		g.publishHashes(r, lagging)
		e.finished(r.id, true, r.computed, r.prompt)
		g.track(r, r.computed)
		return true
	case r.computed >= r.target:
		g.publishHashes(r, r.computed/g.geo.tph)
		e.finished(r.id, false, r.computed, r.computed)
		g.track(r, r.computed)
		return true
	}
	g.publishHashes(r, lagging)
	total := r.prompt
	if r.computed >= r.prompt {
		total = r.computed + 1 // the sampled token is not computed yet
	}
	e.tokens(r.id, r.computed, total)
	next := r.computed + 1
	if r.computed < r.prompt {
		next = min(r.prompt, r.computed+g.w.prefillChunk)
	}
	g.schedule(r, min(next, r.target))
	g.track(r, min(r.computed, total))
	return false
}

func (g *engineGen) publishHashes(r *genReq, upTo int) {
	if upTo > r.hashes && !g.w.noHashes {
		g.enc.hashes(r.id, r.hashes, upTo, g.hash(r))
		r.hashes = upTo
	}
}

// schedule allocates (and publishes) the blocks a step of tokens needs.
func (g *engineGen) schedule(r *genReq, tokens int) {
	r.scheduled = tokens
	need := (tokens + g.geo.tpb - 1) / g.geo.tpb
	if need <= r.blocks {
		return
	}
	for grp := range g.geo.groups() {
		g.idBuf = g.idBuf[:0]
		for range need - r.blocks {
			// Ids cycle through [1, numBlocks): the node does not check
			// content in these phases, only the copy phase does.
			g.blocks[grp] = g.blocks[grp]%uint32(g.geo.numBlocks-1) + 1
			g.idBuf = append(g.idBuf, g.blocks[grp])
		}
		g.enc.blocks(r.id, grp, r.blocks, g.idBuf)
	}
	r.blocks = need
}

// track records the chunks that became ready with offloadable tokens t, as
// the node computes the ready prefix (PROTOCOL.md "ready prefix"); the
// batch being built is their trigger.
func (g *engineGen) track(r *genReq, t int) {
	if g.trigger == nil {
		return
	}
	ready := min(t/g.geo.tokensPerChunk(), r.blocks/g.geo.bpc, r.hashes/g.geo.hashesPerChunk())
	if ready > r.ready {
		g.trigger.record(r.id, r.ready, ready, g.batches)
		r.ready = ready
	}
}

// live seeds n running requests directly in decode (scale phase): prompt of
// one block, 1..63 tokens computed (below the first chunk, so seeding stores
// nothing and later decode steps reach chunk boundaries evenly), prompt
// hashes known, blocks allocated, and no end. Their setup batches are
// returned; next then advances them one decode token per turn.
func (g *engineGen) live(n int) []batch {
	var out []batch
	g.w.running = 0 // admit nobody: the population is fixed
	for i := 0; i < n; {
		g.seq++
		g.enc.begin(g.epoch, g.seq)
		for ; i < n && g.enc.b.Events()+3+g.geo.groups() <= 64; i++ {
			g.reqs++
			r := &genReq{id: "cmpl-" + g.tag + "-" + g.id + "-" + strconv.FormatUint(g.reqs, 10), family: -1,
				abortAt: -1, seed: splitmix64(g.seed ^ g.reqs<<20), prompt: g.geo.tpb, target: 1 << 30, turn: 1}
			c := 1 + g.rng.IntN(g.geo.tokensPerChunk()-1)
			g.enc.added(r.id, r.prompt)
			g.schedule(r, c+1)
			r.computed = c
			g.publishHashes(r, (c-1)/g.geo.tph)
			g.enc.tokens(r.id, c, c+1)
			g.run = append(g.run, r)
		}
		out = append(out, g.enc.finish())
		g.batches++
	}
	return out
}
