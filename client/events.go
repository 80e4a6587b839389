package client

import (
	"fmt"
	"math"

	"github.com/kvactors/kvactors/wire"
)

// The engine's scheduler events: each is mirrored (mirror.go) and appended
// to the batch the next Flush publishes.

// Every event method refuses, before recording anything, an event the
// node would reject, so the engine learns of it at the call rather than by
// a release that never comes: a request id the protocol does not allow
// (ErrBadRequestID, counted in Stats.BadRequestIDs; every event naming it
// is dropped, so the engine must not wait for a release of it), and a
// negative count or start, a group the spec lacks, a block id past its
// num_gpu_blocks, or hashes or block ids past what the spec's
// max_model_len lets a request hold (ErrOutOfRange,
// counted in Stats.OutOfRange), or an empty hash or one over 64 bytes
// (ErrBadHash, counted in Stats.BadHashes); only that event is refused:
// send it again with valid values. Preempted and Resumed take no count and return
// nothing. A refused event is neither sent nor mirrored, so no resync
// re-announces it.

// Added announces a new request with prompt tokens (≥ 0).
func (c *Client) Added(req string, prompt int) error { return c.added(req, prompt, -1, false) }

// AddedMax announces a new request of which kvactors offloads at most
// maxOffload tokens (max_offload_tokens, ≥ 0).
func (c *Client) AddedMax(req string, prompt, maxOffload int) error {
	return c.added(req, prompt, maxOffload, true)
}

// added announces req; maxOffload is sent only withMax.
func (c *Client) added(req string, prompt, maxOffload int, withMax bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, err := c.checkLocked("added", req, count{"prompt_tokens", prompt})
	if err == nil && withMax {
		err = c.countsLocked("added", req, count{"max_offload_tokens", maxOffload})
	}
	if err != nil {
		return err
	}
	if !withMax {
		maxOffload = -1
	}
	if r == nil {
		c.nextN++
		r = &mreq{id: req, n: c.nextN, prompt: prompt, maxOffload: maxOffload, blocks: make([][]uint32, c.groups)}
		c.reqs[req] = r
	}
	c.announcedLocked(r)
	appendAdded(&c.batch, req, prompt, maxOffload)
	c.cutLocked()
	return nil
}

// cutLocked ends the part of the step's batch being appended to once it is
// MaxBatchBytes long: Flush publishes the parts in order, one seq each, so
// a large step stays under NATS' max_payload instead of being refused
// (and becoming a resync of every request). Events of one batch or of
// consecutive ones apply alike: in order, none past a gap.
func (c *Client) cutLocked() {
	if c.batch.Len() >= c.cfg.MaxBatchBytes {
		c.full = append(c.full, c.batch)
		c.batch = wire.Batch{}
	}
}

// count is one count field of an event, by its wire name.
type count struct {
	name string
	v    int
}

// checkLocked checks an event of req (reqLocked) and its counts
// (countsLocked), and returns req's mirror (nil: none).
func (c *Client) checkLocked(ev, req string, counts ...count) (*mreq, error) {
	r, ok := c.reqLocked(req)
	if !ok {
		return nil, fmt.Errorf("client: engine %s: %s %q: %w", c.cfg.Engine, ev, req, ErrBadRequestID)
	}
	return r, c.countsLocked(ev, req, counts...)
}

// countsLocked refuses a negative count: the node rejects the event
// out_of_range and changes nothing (PROTOCOL.md "events"), so a finished
// would never be released and each resync would re-announce the bad value.
// A refused event is counted in Stats.OutOfRange.
func (c *Client) countsLocked(ev, req string, counts ...count) error {
	for _, n := range counts {
		if n.v < 0 {
			return c.outOfRangeLocked(ev, req, fmt.Sprintf("%s = %d is negative", n.name, n.v))
		}
	}
	return nil
}

// boundLocked refuses an event that would take a request past what the
// spec's max_model_len lets it hold (most, 0: not checked): the node
// rejects it too_large and changes nothing, and every later event of the
// kind would be a hole. Counted in Stats.OutOfRange.
func (c *Client) boundLocked(ev, req string, start, n, most int, what string) error {
	if most <= 0 || n <= most-start { // not start+n: start is the caller's
		return nil
	}
	return c.outOfRangeLocked(ev, req, fmt.Sprintf("%d %s from %d: a request holds at most %d under the spec's max_model_len (the node rejects it too_large)",
		n, what, start, most))
}

// mostHashes and mostBlocks are the layout's bounds on a request (0: no
// layout, not checked).
func (c *Client) mostHashes() int {
	if c.lay == nil {
		return 0
	}
	return c.lay.MaxHashes
}

func (c *Client) mostBlocks(group int) int {
	if c.lay == nil || group >= len(c.lay.Groups) {
		return 0
	}
	return c.lay.Groups[group].MaxBlocks
}

// blockIDsLocked refuses a block id at or past the spec's num_gpu_blocks:
// the node rejects the event block_range, and every later blocks event
// of the request would be a hole.
func (c *Client) blockIDsLocked(req string, ids []uint32) error {
	if c.numBlocks <= 0 {
		return nil
	}
	for i, id := range ids {
		if int64(id) >= int64(c.numBlocks) {
			return c.outOfRangeLocked("blocks", req, fmt.Sprintf("ids[%d] = %d, the spec has %d GPU blocks", i, id, c.numBlocks))
		}
	}
	return nil
}

func (c *Client) outOfRangeLocked(ev, req, why string) error {
	c.st.OutOfRange++
	return fmt.Errorf("client: engine %s: %s %q: %w: %s", c.cfg.Engine, ev, req, ErrOutOfRange, why)
}

// hashesLocked refuses an empty hash or one over the node's 64 bytes: the
// node rejects the event bad_hash and changes nothing, so every later
// hashes event of the request would be a hole, and every resync would
// re-announce the bad one. A refused event is counted in Stats.BadHashes.
func (c *Client) hashesLocked(req string, hashes [][]byte) error {
	for i, h := range hashes {
		if len(h) == 0 || len(h) > protocolLimits.MaxHashBytes {
			c.st.BadHashes++
			return fmt.Errorf("client: engine %s: hashes %q: %w: hashes[%d] is %d bytes", c.cfg.Engine, req,
				ErrBadHash, i, len(h))
		}
	}
	return nil
}

// reqLocked is req's mirror (nil: none) and whether an event naming req
// may be sent: a mirrored id passed Added's check; another must pass it
// now, or the wire would carry another id (invalid UTF-8 becomes U+FFFD)
// or one the node rejects, and the engine would wait for a release that
// names it in vain. A refused event is counted in Stats.BadRequestIDs.
func (c *Client) reqLocked(req string) (*mreq, bool) {
	if r := c.reqs[req]; r != nil {
		return r, true
	}
	if !validRequestID(req) {
		c.st.BadRequestIDs++
		return nil, false
	}
	return nil, true
}

// announcedLocked notes that an event of r is in the batch: unless the
// node has forgotten the engine (its batches are discarded then), the
// node may hold r once the batch is published (atNodeLocked).
func (c *Client) announcedLocked(r *mreq) {
	if r == nil || r.atNode || c.reregister {
		return
	}
	if c.unsent == nil {
		c.unsent = map[*mreq]struct{}{}
	}
	c.unsent[r] = struct{}{}
}

// atNodeLocked notes that a batch was published that may reach the node:
// it may hold every request with events in the step's batch from now on.
func (c *Client) atNodeLocked() {
	for r := range c.unsent {
		r.atNode = true
	}
	clear(c.unsent)
}

// appendAdded appends added, with max_offload_tokens when maxOffload ≥ 0.
func appendAdded(b *wire.Batch, req string, prompt, maxOffload int) {
	if maxOffload >= 0 {
		b.AddedMax(req, prompt, maxOffload)
		return
	}
	b.Added(req, prompt)
}

// Hashes announces block hashes hashes[start...] of req (raw bytes, each
// 1..64 of them; the client copies them); start ≥ 0. An empty or longer
// hash refuses the whole event (ErrBadHash), as the node would.
func (c *Client) Hashes(req string, start int, hashes ...[]byte) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, err := c.checkLocked("hashes", req, count{"start", start})
	if err == nil && start > math.MaxInt-len(hashes) {
		err = c.outOfRangeLocked("hashes", req, "start + len(hashes) overflows")
	}
	if err == nil {
		err = c.boundLocked("hashes", req, start, len(hashes), c.mostHashes(), "hashes")
	}
	if err == nil {
		err = c.hashesLocked(req, hashes)
	}
	if err != nil {
		return err
	}
	if r != nil {
		r.addHashes(start, hashes)
		c.announcedLocked(r)
	}
	c.batch.BeginHashes(req, start)
	for i, h := range hashes {
		if i > 0 && c.batch.Len() >= c.cfg.MaxBatchBytes {
			c.batch.EndHashes()
			c.cutLocked()
			c.batch.BeginHashes(req, start+i)
		}
		c.batch.Hash(h)
	}
	c.batch.EndHashes()
	c.cutLocked()
	return nil
}

// Blocks announces GPU block ids block_ids[group][start...] of req; group
// is one of the spec's, start ≥ 0, every id below the spec's
// num_gpu_blocks, start+len(ids) within ceil(max_model_len /
// tokens_per_block) (sched.Layout's MaxBlocks, as the node bounds it).
func (c *Client) Blocks(req string, group, start int, ids []uint32) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, err := c.checkLocked("blocks", req, count{"group", group}, count{"start", start})
	switch {
	case err != nil:
	case group >= c.groups: // the node: bad_group (or out_of_range past max_groups)
		err = c.outOfRangeLocked("blocks", req, fmt.Sprintf("group = %d, the spec has %d", group, c.groups))
	case start > math.MaxInt-len(ids):
		err = c.outOfRangeLocked("blocks", req, "start + len(ids) overflows")
	default:
		if err = c.boundLocked("blocks", req, start, len(ids), c.mostBlocks(group), "block ids"); err == nil {
			err = c.blockIDsLocked(req, ids)
		}
	}
	if err != nil {
		return err
	}
	if r != nil && r.phase == running {
		r.addBlocks(group, start, ids)
	}
	c.announcedLocked(r)
	// Each part takes the ids the batch has room for (an id is at most 11
	// bytes: 10 digits and a comma), at least one, so no part takes the
	// batch past MaxBatchBytes by more than its envelope (appended whole to
	// a nearly full batch, the ids could take it to twice the bound, past
	// NATS' max payload).
	for s := 0; ; {
		e := min(s+max((c.cfg.MaxBatchBytes-c.batch.Len())/11, 1), len(ids))
		c.batch.Blocks(req, group, start+s, ids[s:e])
		c.cutLocked()
		if s = e; s == len(ids) {
			return nil
		}
	}
}

// Tokens announces that the KV of tokens [0, computed) is written and
// fenced; total is the sequence length. Both are ≥ 0.
func (c *Client) Tokens(req string, computed, total int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, err := c.checkLocked("tokens", req, count{"computed", computed}, count{"total", total})
	if err != nil {
		return err
	}
	if r != nil && r.phase != finished {
		r.computed, r.total, r.hasTokens = computed, total, true
		r.postTok = r.phase == preempted
	}
	c.announcedLocked(r)
	c.batch.Tokens(req, computed, total)
	c.cutLocked()
	return nil
}

// Preempted announces that the engine wants req's blocks back; OnReleased
// says when it may reuse them. Every Preempted of a running request and
// every Finished of a request not finished yet is answered by exactly one
// OnReleased call (a resume before the preemption's release makes two
// owed; they are answered in order).
func (c *Client) Preempted(req string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.reqLocked(req)
	if !ok {
		return
	}
	c.batch.Preempted(req)
	c.cutLocked()
	c.announcedLocked(r)
	if r == nil || r.phase != running {
		return // the node ignores it too
	}
	r.phase = preempted
	r.preComputed, r.preTotal, r.preHasTokens, r.postTok = r.computed, r.total, r.hasTokens, false
	// The node forgets computed here (the blocks the request resumes with
	// hold no KV until a tokens says so): so must the mirror, or a resync
	// after resumed and new blocks would tell the node they hold the old
	// computed, and it would store their unwritten bytes under the prompt's
	// keys.
	r.computed = 0
	r.owed++
	c.freeIfNoNodeLocked(r)
}

// Resumed announces that req runs again; fresh Blocks from start 0 follow.
func (c *Client) Resumed(req string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.reqLocked(req)
	if !ok {
		return
	}
	if r != nil && r.phase == preempted {
		r.phase = running
		r.clearBlocks()
	}
	c.announcedLocked(r)
	c.batch.Resumed(req)
	c.cutLocked()
}

// Finished announces that req ended; OnReleased says when its blocks may be
// reused. computed and total are as in Tokens. A refused Finished is owed
// no release: call it again with valid counts, or the node keeps the
// request, and may store from its blocks, for good. A Finished of a
// request already finished whose release has not come yet is a no-op
// (nil; nothing sent, nothing recorded, no second release owed): sent,
// the node would answer it with a second release had it released the
// first by then.
func (c *Client) Finished(req string, aborted bool, computed, total int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, err := c.checkLocked("finished", req, count{"computed", computed}, count{"total", total})
	if err != nil {
		return err
	}
	if r != nil && r.phase == finished {
		return nil
	}
	c.batch.Finished(req, aborted, computed, total)
	c.cutLocked()
	if r == nil {
		// The node answers a finished for a request it does not hold with
		// a release at once; nothing waits for it here.
		if c.unknownFin == nil {
			c.unknownFin = map[string]int{}
		}
		c.unknownFin[req]++
		return nil
	}
	c.announcedLocked(r)
	r.finPre = r.phase == preempted // its blocks go back with the preemption's release
	r.phase, r.aborted, r.computed, r.total = finished, aborted, computed, total
	r.owed++
	c.freeIfNoNodeLocked(r)
	return nil
}
