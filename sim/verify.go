package sim

import (
	"bytes"
	"context"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/sched"
)

// outcome is what loading one key back found.
type outcome uint8

const (
	unchecked  outcome = iota
	matched            // loaded; every byte is the pattern
	mismatched         // loaded; some byte is not
	absent             // the load said the key is not ready
	loadFailed         // the load failed for another reason
)

// verify is the final check (package doc). Phase one loads every key
// reported stored, through the request that first reported it, into the
// scratch blocks and compares the bytes. Phase two walks every chunk that
// was ready when a request finished: stored for that request, or present
// (stored by another request or engine: loaded and compared too), or,
// failing both, evicted or missing.
func (e *engine) verify(ctx context.Context, kvSub *nats.Subscription) error {
	v := &verifier{e: e, kvSub: kvSub, seen: map[string]outcome{}, buf: make([]byte, e.cfg.BlockBytes)}
	byReq := map[*request][]chunkRef{}
	for _, ref := range e.storedKeys {
		byReq[ref.req] = append(byReq[ref.req], ref.ch)
	}
	for _, r := range e.reqs {
		if chunks := byReq[r]; len(chunks) > 0 {
			if err := v.lookup(r); err != nil {
				return err
			}
			if err := v.check(ctx, r, chunks); err != nil {
				return err
			}
		}
	}
	if err := v.ready(ctx); err != nil {
		return err
	}
	v.tally()
	v.checkHits()
	return nil
}

// checkHits holds each lookup to what the loads then found: a key this
// engine was told is stored before the check began, and that the check
// loaded back matching, was ready when the lookup asked, unless something
// was evicted or the node lost (then it may have gone and come back). So
// the hit must be at least what the node's own rule (sched.Layout.HitTokens,
// PROTOCOL.md "lookup") gives over those keys; a node whose lookup hit
// nothing would otherwise pass.
func (v *verifier) checkHits() {
	e := v.e
	e.kv.mu.Lock()
	evictions := e.kv.evictions
	e.kv.mu.Unlock()
	if evictions > 0 || e.c.Stats().NodeLosses > 0 || len(v.hits) == 0 {
		return
	}
	spec := e.mem.spec()
	layout, err := sched.NewLayout(&spec)
	if err != nil {
		e.badMessage("lookup check: the engine's own spec: %v", err)
		return
	}
	there := func(k messages.Key) bool {
		key := hex.EncodeToString([]byte(sched.WireKey(k)))
		_, stored := e.storedKeys[key]
		return stored && v.seen[key] == matched
	}
	for _, r := range e.reqs {
		hit, ok := v.hits[r]
		if !ok {
			continue
		}
		hs := make([]messages.Hash, len(r.hashes))
		for i := range r.hashes {
			hs[i] = messages.Hash(r.hashes[i][:])
		}
		if want := layout.HitTokens(hs, there); hit < want {
			e.badMessage("lookup of %s: hit %d tokens, but its first %d were stored and loaded back intact, "+
				"with nothing evicted", r.id, hit, want)
		}
	}
}

// tally counts each key loaded once: matched, mismatched, absent because
// evicted, or failed. A key only met as some request's ready chunk that
// could not be loaded is not a verify failure: ready() counted it Missing.
func (v *verifier) tally() {
	e := v.e
	for key, o := range v.seen {
		ref, stored := e.storedKeys[key]
		switch {
		case o == matched:
			e.rep.VerifyOK++
		case o == absent:
			e.rep.VerifyEvicted++
		case o == mismatched || stored:
			e.rep.VerifyFailed++
			if stored {
				e.rep.fail("stored key %s (request %s, group %d, chunk %d): %s", key, ref.req.id, ref.ch.group,
					ref.ch.index, v.why[key])
			} else {
				e.rep.fail("present key %s: %s", key, v.why[key])
			}
		}
	}
}

// verifier holds the check's state; it runs on Run's goroutine.
type verifier struct {
	e     *engine
	kvSub *nats.Subscription
	seen  map[string]outcome // by key hex
	why   map[string]string  // by key hex, for failures
	buf   []byte
	loads int
	hits  map[*request]int // each lookup's hit tokens, for checkHits
}

// ready is phase two.
func (v *verifier) ready(ctx context.Context) error {
	e := v.e
	for _, r := range e.reqs {
		if r.phase != ended || r.aborted {
			continue
		}
		var unknown []chunkRef
		for _, ch := range r.readyChunks(&e.cfg) {
			if r.nodeLost {
				break // the release said node_lost: absence is excused, no load needed to tell
			}
			// Keys this engine was told are stored were checked in phase one;
			// a chunk once null may rightly never have been stored at all.
			key, _ := r.key(&e.cfg, ch) // a ready chunk's hashes are known
			if !r.stored[ch] && !r.nulled[ch] && v.seen[key] == unchecked {
				unknown = append(unknown, ch)
			}
		}
		if err := v.check(ctx, r, unknown); err != nil {
			return err
		}
		for _, ch := range r.readyChunks(&e.cfg) {
			e.rep.ChunksReady++
			key, _ := r.key(&e.cfg, ch)
			switch {
			case r.stored[ch]:
				e.rep.ReadyStored++
			case v.seen[key] == matched || v.seen[key] == mismatched:
				e.rep.Deduplicated++
			case v.seen[key] == absent:
				e.rep.ReadyEvicted++
			case r.nulled[ch]:
				e.rep.ReadySkipped++
			case r.nodeLost:
				// Its release said node_lost: the node may have died before
				// storing it, and the engine was told so (PROTOCOL.md "Resync").
				e.rep.ReadyNodeLost++
			default:
				e.rep.Missing++
				e.rep.fail("request %s: ready chunk %d of group %d (key %s) was neither stored nor present: %s",
					r.id, ch.index, ch.group, key, v.why[key])
			}
		}
	}
	return nil
}

// lookup asks kvactors how many tokens of r's prefix it holds.
func (v *verifier) lookup(r *request) error {
	hs := make([]string, len(r.hashes))
	for i := range r.hashes {
		hs[i] = hex.EncodeToString(r.hashes[i][:])
	}
	var reply messages.LookupReply
	if err := v.e.request(messages.VerbLookup, messages.LookupRequest{Hashes: hs}, &reply); err != nil {
		return err
	}
	v.e.rep.Lookups++
	if reply.Error != "" {
		v.e.badMessage("lookup of %s: %s", r.id, reply.Error)
		return nil
	}
	if reply.HitTokens < 0 || reply.HitTokens > len(r.hashes)*v.e.cfg.TokensPerHash {
		v.e.badMessage("lookup of %s: hit %d tokens of %d hashed", r.id, reply.HitTokens,
			len(r.hashes)*v.e.cfg.TokensPerHash)
	}
	v.e.rep.LookupHitTokens += int64(reply.HitTokens)
	if v.hits == nil {
		v.hits = map[*request]int{}
	}
	v.hits[r] = reply.HitTokens
	return nil
}

// check loads chunks of r not seen yet, in batches that fit the scratch
// blocks, and records each key's outcome. A batch that fails because a key
// is absent is retried chunk by chunk; a key still absent and not evicted
// is retried a few times more, since another engine may be storing it.
func (v *verifier) check(ctx context.Context, r *request, chunks []chunkRef) error {
	c := &v.e.cfg
	chunks = slices.DeleteFunc(slices.Clone(chunks), func(ch chunkRef) bool {
		key, _ := r.key(c, ch)
		return v.seen[key] != unchecked
	})
	slices.SortFunc(chunks, func(a, b chunkRef) int {
		return cmpChunk(a, b)
	})
	perLoad := c.VerifyBlocks / c.BlocksPerChunk
	for len(chunks) > 0 {
		n, count := 0, make([]int, len(c.Groups))
		for n < len(chunks) && count[chunks[n].group] < perLoad {
			count[chunks[n].group]++
			n++
		}
		if err := v.batch(ctx, r, chunks[:n]); err != nil {
			return err
		}
		chunks = chunks[n:]
	}
	return nil
}

func (v *verifier) batch(ctx context.Context, r *request, chunks []chunkRef) error {
	if len(chunks) == 0 {
		return nil
	}
	errText, err := v.load(ctx, r, chunks)
	if err != nil {
		return err
	}
	if errText == "" {
		return nil
	}
	if len(chunks) > 1 && isAbsent(errText) {
		for _, ch := range chunks {
			if err := v.batch(ctx, r, []chunkRef{ch}); err != nil {
				return err
			}
		}
		return nil
	}
	key, _ := r.key(&v.e.cfg, chunks[0])
	if len(chunks) > 1 || !isAbsent(errText) {
		for _, ch := range chunks {
			k, _ := r.key(&v.e.cfg, ch)
			v.record(k, loadFailed, "load failed: "+errText)
		}
		return nil
	}
	for attempt := 0; ; attempt++ {
		if v.e.wasEvicted(v.kvSub, key) {
			v.record(key, absent, "evicted")
			return nil
		}
		if attempt == 3 {
			v.record(key, loadFailed, "absent and never evicted: "+errText)
			return nil
		}
		if errText, err = v.load(ctx, r, chunks); err != nil || errText == "" {
			return err
		}
	}
}

func isAbsent(errText string) bool { return strings.Contains(errText, "not ready") }

func isNoRoom(errText string) bool { return strings.Contains(errText, "no room") }

func (v *verifier) record(key string, o outcome, why string) {
	v.seen[key] = o
	if why != "" {
		if v.why == nil {
			v.why = map[string]string{}
		}
		v.why[key] = why
	}
}

// load copies chunks of r into the scratch blocks through P.E.load and, if
// it worked, compares them with the pattern and records the outcomes. It
// returns the load's error text ("" when it loaded), or an error when the
// request itself failed.
func (v *verifier) load(ctx context.Context, r *request, chunks []chunkRef) (string, error) {
	if err := ctx.Err(); err != nil {
		return "", fmt.Errorf("sim: verify: %w", err)
	}
	e, c := v.e, &v.e.cfg
	scratch := verifyBlocks(c)
	tokens := 0
	for _, ch := range chunks {
		tokens = max(tokens, (ch.index+1)*c.Groups[ch.group].TokensPerBlock*c.BlocksPerChunk)
	}
	blocks := make([][]int64, len(c.Groups))
	for g, gc := range c.Groups {
		blocks[g] = make([]int64, tokens/(gc.TokensPerBlock*c.BlocksPerChunk)*c.BlocksPerChunk)
	}
	target := make([][]uint32, len(chunks)) // scratch ids of each chunk
	next := make([]int, len(c.Groups))
	for i, ch := range chunks {
		for b := range c.BlocksPerChunk {
			id := scratch[next[ch.group]]
			next[ch.group]++
			blocks[ch.group][ch.index*c.BlocksPerChunk+b] = int64(id)
			target[i] = append(target[i], id)
			for reg := range c.RegionsPerGroup {
				clear(e.mem.block(ch.group, reg, id)) // a load that copies nothing must not pass
			}
		}
	}
	hs := make([]string, tokens/c.TokensPerHash)
	for i := range hs {
		hs[i] = hex.EncodeToString(r.hashes[i][:])
	}
	v.loads++
	var reply messages.LoadReply
	req := messages.LoadRequest{Request: fmt.Sprintf("verify-%d", v.loads), Hashes: hs, NumTokens: tokens, Blocks: blocks}
	// "No room" is transient: a pool about the size of one load has no room
	// for it while the other engine's load holds some of it pinned. Try
	// again, bounded (about 2.5 s in all).
	for wait := 10 * time.Millisecond; ; wait *= 2 {
		reply = messages.LoadReply{}
		if err := e.request(messages.VerbLoad, req, &reply); err != nil {
			return "", err
		}
		if reply.OK || !isNoRoom(reply.Error) || wait > time.Second {
			break
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("sim: verify: %w", ctx.Err())
		case <-time.After(wait):
		}
	}
	if !reply.OK {
		if reply.Error == "" {
			reply.Error = "no ok and no error"
		}
		return reply.Error, nil
	}
	for i, ch := range chunks {
		key, _ := r.key(c, ch)
		o, why := v.compare(r, ch, target[i])
		v.record(key, o, why)
	}
	return "", nil
}

// compare checks one loaded chunk, block by block and region by region.
func (v *verifier) compare(r *request, ch chunkRef, ids []uint32) (outcome, string) {
	c := &v.e.cfg
	tpb := c.Groups[ch.group].TokensPerBlock
	for i, id := range ids {
		b := ch.index*c.BlocksPerChunk + i
		last := blockHash(r.hashes, b, tpb, c.TokensPerHash)
		for reg := range c.RegionsPerGroup {
			FillBlock(v.buf, last, ch.group, reg, b)
			got := v.e.mem.block(ch.group, reg, id)
			if !bytes.Equal(got, v.buf) {
				at := 0
				for at < len(got) && got[at] == v.buf[at] {
					at++
				}
				return mismatched, fmt.Sprintf("block %d of the chunk, region %d: first differing byte at %d "+
					"(got %#02x, want %#02x)", i, reg, at, got[at], v.buf[at])
			}
		}
	}
	v.e.rep.VerifiedBytes += int64(len(ids)*c.RegionsPerGroup) * c.BlockBytes
	return matched, ""
}

func cmpChunk(a, b chunkRef) int {
	if a.group != b.group {
		return a.group - b.group
	}
	return a.index - b.index
}
