package sched

// A request's store decision: which ready chunks to offer the pool, their
// keys, and the job built from the room it gave.

import (
	"slices"
	"sync"
	"unsafe"

	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/messages"
)

// scratch is a decision's working memory. It is pooled across requests
// rather than kept per request: a live request holds none of it, and a
// retry storm under overload (every event re-offering a prefill's chunks)
// allocates nothing for it.
type scratch struct {
	cands   []candidate
	keys    []messages.Key
	missing []candidate    // chunks whose keys a decision builds
	built   []messages.Key // their keys
	starts  []int          // per group, where its chunks past its key cache start in missing
	sizes   []int64        // bytes of each offered chunk
	// per group, for capToRoom: its chunks' bytes and how many are offered
	groupSizes, groupCounts []int64
	prep                    hostpool.Prepared
}

var scratchPool = sync.Pool{New: func() any { return new(scratch) }}

// scratchMax bounds what a pooled scratch keeps (a huge prefill's buffers
// are dropped rather than pooled).
const scratchMax = 4096

func (sc *scratch) release() {
	clear(sc.keys) // no pooled reference to keys the pool may evict
	clear(sc.built)
	clear(sc.prep.Keys)
	clear(sc.prep.Pending)
	clear(sc.prep.Evicted)
	clear(sc.prep.Victims) // their keys and extents, kept for a disk tier
	sc.prep.Reset()        // empty for the next decision; its Ext is the job's now
	if cap(sc.cands) > scratchMax || cap(sc.keys) > scratchMax || cap(sc.missing) > scratchMax ||
		cap(sc.prep.Evicted) > scratchMax || cap(sc.prep.Pending) > scratchMax || cap(sc.prep.Victims) > scratchMax {
		return
	}
	sc.cands, sc.keys, sc.missing, sc.built, sc.starts, sc.sizes = sc.cands[:0], sc.keys[:0], sc.missing[:0],
		sc.built[:0], sc.starts[:0], sc.sizes[:0]
	scratchPool.Put(sc)
}

// decide takes the request's store decision. One capped to what the pool
// holds (capToRoom) that made no job (its chunks all present) but moved the
// cursors asks for another decision (Effects.More): nothing else would take
// one for the rest, no job of it completing.
func (r *Request) decide(p Preparer, e *Effects) {
	e.More = r.decideOnce(p, e)
}

// decideOnce is one decision; more: it was capped, made no job and moved
// a cursor, so the rest is still to decide.
func (r *Request) decideOnce(p Preparer, e *Effects) (more bool) {
	tm := r.readyTerms()
	var ready [8]messages.ChunkIndex // most engines have few groups: no allocation
	readies := ready[:0]
	offers := false
	for g := range r.groups {
		gr := &r.groups[g]
		rd, reason, best := r.ready(g, tm)
		readies = append(readies, rd)
		if best > rd { // something about chunk rd is known, but not all: a deferral
			if d := (deferNote{int32(rd), reason}); d != gr.lastDefer {
				gr.lastDefer = d
				e.Deferred.add(Deferral{Group: g, Chunk: rd, Reason: reason})
			}
		}
		for range gr.candidates(&r.lay.Groups[g], rd, tm.bpc) {
			offers = true
			break
		}
	}
	if !offers {
		// Most decisions (a token step, a step without a new chunk) offer
		// nothing: what the rest does with no keys, without its scratch.
		r.poolFails, r.pendFails = 0, 0
		for g := range r.groups {
			r.decided(g, readies[g])
		}
		return false
	}
	sc := scratchPool.Get().(*scratch)
	defer sc.release()
	capped := false
	if b, ok := p.(Bounded); ok {
		capped = r.capToRoom(readies, tm.bpc, b, sc)
	}
	cands := sc.cands[:0]
	keys := sc.keys[:0]
	for g := range r.groups {
		for c := range r.groups[g].candidates(&r.lay.Groups[g], readies[g], tm.bpc) {
			cands = append(cands, candidate{g, c})
		}
	}
	keys = r.candidateKeys(keys, cands, readies, sc)
	sc.cands, sc.keys = cands, keys
	prep := &sc.prep // empty (scratch.release); the Preparer writes over it
	if len(keys) > 0 {
		sizes := sc.sizes[:0]
		for _, c := range cands {
			sizes = append(sizes, r.lay.Groups[c.group].ChunkBytes)
		}
		sc.sizes = sizes
		if err := p.PrepareStoreInto(prep, keys, sizes); err != nil { // no room, or a pool that refuses the keys: retry either way
			r.cacheKeys(sc)
			r.failAttempt(RetryPoolFull, e)
			e.RoomGen = prep.RoomGen
			return false
		}
	}
	r.poolFails = 0
	moved := false // a cursor moves, or a chunk to redo is decided: progress
	for g := range r.groups {
		gr := &r.groups[g]
		if capped && !moved {
			moved = readies[g] > gr.cursor || slices.ContainsFunc(gr.redo(), func(c messages.ChunkIndex) bool {
				return c < readies[g]
			})
		}
		r.decided(g, readies[g])
	}
	e.Evicted = len(prep.Evicted)
	e.Deduped += len(keys) - len(prep.Keys) - len(prep.Pending)
	r.holdPending(cands, keys, prep.Pending, e)
	if len(prep.Keys) == 0 {
		// Chunks pending in other copies armed a retry, which decides again.
		return capped && moved && len(prep.Pending) == 0
	}
	e.Job = r.buildJob(cands, keys, prep)
	last := &r.inflight
	for *last != nil {
		last = &(*last).next
	}
	*last = e.Job
	return false
}

// Bounded is a Preparer that knows what it can ever hold: a decision offers
// it no more (capToRoom).
type Bounded interface {
	// HoldsEmpty reports whether the pool, empty, holds counts[i] chunks of
	// sizes[i] bytes for every i (hostpool.Pool.HoldsEmpty: by pages).
	HoldsEmpty(sizes, counts []int64) bool
}

// capToRoom lowers readies so that one decision's candidates are no more
// than the pool holds empty, where they would be more (kvactors' choice,
// docs/PROTOCOL.md "A decision larger than the pool"). A decision is all or nothing against
// the pool, so a request whose ready chunks need more than the whole pool
// would store none of them, ever, and a finishing one would hold the
// engine's blocks through every retry before giving them all up.
//
// The bound is one token position for every group, so a prefix stored is
// stored in every group alike (a lookup hits the least of them). The rest
// stays ready and is offered by the next decision (a job that completes
// decides again; one that made no job asks for more: Effects.More); at
// least one chunk is always offered (register refuses a chunk the pool
// cannot hold).
func (r *Request) capToRoom(readies []messages.ChunkIndex, bpc int, b Bounded, sc *scratch) (capped bool) {
	// By what the pool can ever hold (pages, not bytes: a set within the
	// pool's bytes whose tails waste part of each page may need more pages
	// than there are, and would be refused at every retry). sizes and
	// counts are per group.
	sizes, counts := sc.groupSizes[:0], sc.groupCounts[:0]
	for g := range r.groups {
		sizes = append(sizes, r.lay.Groups[g].ChunkBytes)
		counts = append(counts, 0)
	}
	sc.groupSizes, sc.groupCounts = sizes, counts
	// Most decisions are far within the pool: an upper bound from the
	// cursors (every chunk from the cursor to ready, and every redo one,
	// counted) settles them without walking the candidates again.
	for g := range r.groups {
		gr := &r.groups[g]
		n := int64(len(gr.redo()))
		if readies[g] > gr.cursor {
			n += int64(readies[g] - gr.cursor)
		}
		counts[g] = n
	}
	if b.HoldsEmpty(sizes, counts) {
		return false
	}
	// below counts the candidates under a token position into counts and
	// returns how many there are.
	below := func(tokens int) (n int64) {
		for g := range r.groups {
			gl := &r.lay.Groups[g]
			rd := min(readies[g], messages.ChunkIndex(tokens/gl.TokensPerChunk))
			counts[g] = 0
			for range r.groups[g].candidates(gl, rd, bpc) {
				counts[g]++
			}
			n += counts[g]
		}
		return n
	}
	fits := func(tokens int) bool {
		below(tokens)
		return b.HoldsEmpty(sizes, counts)
	}
	hi := 0 // tokens past every group's ready bound
	for g := range r.groups {
		hi = max(hi, int(readies[g])*r.lay.Groups[g].TokensPerChunk)
	}
	if fits(hi) {
		return false
	}
	// The most tokens whose candidates fit: they only grow with tokens.
	lo, up := 0, hi
	for lo < up {
		mid := lo + (up-lo+1)/2
		if fits(mid) {
			lo = mid
		} else {
			up = mid - 1
		}
	}
	if below(lo) == 0 { // not even one chunk fits: the first one alone
		lo, up = 0, hi
		for lo < up {
			mid := lo + (up-lo)/2
			if below(mid) > 0 {
				up = mid
			} else {
				lo = mid + 1
			}
		}
	}
	for g := range r.groups {
		readies[g] = min(readies[g], messages.ChunkIndex(lo/r.lay.Groups[g].TokensPerChunk))
	}
	return true
}

// holdPending keeps the chunks whose keys another copy is still filling as
// redo chunks and asks for a retry: that copy may yet fail or be cancelled
// (an engine reset cancels a dead epoch's queued copies) and free the key,
// and a ready chunk is never skipped (PROTOCOL.md). Once the key is ready the
// retry deduplicates it; once it is absent the retry stores it. pending is an
// ordered subsequence of keys.
func (r *Request) holdPending(cands []candidate, keys, pending []messages.Key, e *Effects) {
	if len(pending) == 0 {
		r.pendFails = 0
		return
	}
	next := 0
	for i, c := range cands {
		if next < len(pending) && pending[next] == keys[i] {
			r.groups[c.group].addRedo(c.chunk)
			next++
		}
	}
	r.failAttempt(RetryPending, e)
	if e.Retry != nil { // not given up
		e.Pending = append([]messages.Key(nil), pending...) // pending is the decision's scratch
	}
}

// candidateKeys returns the keys of cands. Keys of chunks at or past the
// cursor come from the group's cache, and those past the cache are built
// (cacheKeys keeps them if the pool has no room). Redo chunks (below the
// cursor, rare) get fresh keys. The new keys of a decision share one
// allocation (appendKeys).
func (r *Request) candidateKeys(keys []messages.Key, cands []candidate, readies []messages.ChunkIndex,
	sc *scratch) []messages.Key {
	missing, starts := sc.missing[:0], sc.starts[:0]
	for g := range r.groups {
		gr := &r.groups[g]
		starts = append(starts, len(missing))
		for c := gr.cursor + messages.ChunkIndex(len(gr.cachedKeys())); c < readies[g]; c++ {
			missing = append(missing, candidate{g, c})
		}
	}
	extend := len(missing)
	starts = append(starts, extend)
	for _, c := range cands {
		if c.chunk < r.groups[c.group].cursor {
			missing = append(missing, c)
		}
	}
	built := r.appendKeys(sc.built[:0], missing)
	redo := built[extend:]
	for _, c := range cands {
		gr := &r.groups[c.group]
		if c.chunk < gr.cursor {
			keys, redo = append(keys, redo[0]), redo[1:]
			continue
		}
		i, cached := int(c.chunk-gr.cursor), gr.cachedKeys()
		if i < len(cached) {
			keys = append(keys, cached[i])
		} else {
			keys = append(keys, built[starts[c.group]+i-len(cached)])
		}
	}
	sc.missing, sc.built, sc.starts = missing, built, starts
	return keys
}

// cacheKeys keeps the keys candidateKeys built past each group's cache, for
// a decision the pool had no room for. The cache is charged to the
// engine's StateBudget like the request's lists (a decision may offer a
// key per group for every chunk the pool holds: more than the hashes and
// ids it was built from); a group whose keys the budget cannot take
// caches none, and its next decision builds them again.
//
// A decision's new keys share one string (appendKeys): they are cached as
// they are only if all of them are, charged together. Otherwise (a redo
// chunk's key, a group the budget refused) each group caches its own
// copy: kept as they were, a group's few keys would keep the rest
// reachable, uncharged, each decision another group's whole backlog.
func (r *Request) cacheKeys(sc *scratch) {
	ng := len(r.groups)
	if len(sc.built) == sc.starts[ng] { // no redo chunk's key among them
		var cost int64
		for g := range r.groups {
			cost += r.keysCharge(g, sc.built[sc.starts[g]:sc.starts[g+1]])
		}
		if r.charge(cost) == nil {
			for g := range r.groups {
				r.groups[g].cacheKeys(sc.built[sc.starts[g]:sc.starts[g+1]], false)
			}
			return
		}
	}
	for g := range r.groups {
		keys := sc.built[sc.starts[g]:sc.starts[g+1]]
		if len(keys) == 0 || r.charge(r.keysCharge(g, keys)) != nil {
			continue
		}
		r.groups[g].cacheKeys(keys, true)
	}
}

// keysCharge is what group g's key cache costs more with keys added to it:
// their bytes, and the headers of the capacity it grows by (keysCap).
func (r *Request) keysCharge(g int, keys []messages.Key) int64 {
	if len(keys) == 0 {
		return 0
	}
	old := r.groups[g].cachedKeys()
	return int64(keysCap(old, len(keys))-cap(old))*hashHeaderBytes + bytesOf(keys) // a Key's header, as a Hash's
}

// decided moves group g's cursor to rd (group.decided), giving back its
// cached keys' charge: they are below the cursor now.
func (r *Request) decided(g int, rd messages.ChunkIndex) {
	r.uncharge(keysCost(r.groups[g].cachedKeys()))
	r.groups[g].decided(rd)
}

// keysCost is what a key cache is charged: its capacity's headers and its
// keys' bytes.
func keysCost(keys []messages.Key) int64 {
	return int64(cap(keys))*hashHeaderBytes + bytesOf(keys)
}

// appendKeys builds the pool keys of cands in one allocation: the keys are
// substrings of one string (a decision's keys are stored, and later evicted,
// together, so sharing their backing costs little).
func (r *Request) appendKeys(keys []messages.Key, cands []candidate) []messages.Key {
	hashOf := func(c candidate) messages.Hash {
		return r.hashes[(int(c.chunk)+1)*r.lay.Groups[c.group].HashesPerChunk-1]
	}
	size := 0
	for _, c := range cands {
		size += keyNSBytes + len(hashOf(c)) + keyGroupBytes
	}
	b := make([]byte, 0, size)
	for _, c := range cands {
		b = AppendKey(b, r.lay.Namespace, hashOf(c), c.group)
	}
	all, off := unsafe.String(unsafe.SliceData(b), len(b)), 0 // b is not written again
	for _, c := range cands {
		n := keyNSBytes + len(hashOf(c)) + keyGroupBytes
		keys = append(keys, messages.Key(all[off:off+n]))
		off += n
	}
	return keys
}

// roomOf is prep's room for its i'th key, nil when the preparer reported
// none (a test double): the copy then locates the key itself.
func roomOf(prep *hostpool.Prepared, i int) []hostpool.Extent {
	if i >= len(prep.Ends) {
		return nil
	}
	return prep.Chunk(i)
}

// slotOf is prep's pool entry for its i'th key, -1 when it reported none.
func slotOf(prep *hostpool.Prepared, i int) int32 {
	if i >= len(prep.Slots) {
		return -1
	}
	return prep.Slots[i]
}

func (r *Request) buildJob(cands []candidate, keys []messages.Key, prep *hostpool.Prepared) *StoreJob {
	r.nextJob++
	job := &StoreJob{ID: r.nextJob, Request: r.id, Chunks: make([]JobChunk, 0, len(prep.Keys))}
	bpc := r.lay.BlocksPerChunk
	next := 0 // prep.Keys is an ordered subsequence of keys
	for i, c := range cands {
		if next >= len(prep.Keys) || prep.Keys[next] != keys[i] {
			continue
		}
		job.Chunks = append(job.Chunks, JobChunk{Group: c.group, Index: c.chunk, Key: keys[i],
			Blocks: r.groups[c.group].chunkIDs(c.chunk, bpc), Room: roomOf(prep, next), Slot: slotOf(prep, next)})
		next++
	}
	return job
}
