package client

import (
	"fmt"

	"github.com/kvactors/kvactors/wire"
)

// The engine's scheduler events: each is mirrored (mirror.go) and appended
// to the batch the next Flush publishes.

// Added announces a new request with prompt tokens. An id the protocol
// does not allow (ErrBadRequestID) is refused: nothing is announced, and
// the client drops later events naming it, so the engine must not wait
// for a release of it.
func (c *Client) Added(req string, prompt int) error { return c.added(req, prompt, -1) }

// AddedMax announces a new request of which kvactors offloads at most
// maxOffload tokens (max_offload_tokens, ≥ 0). Its error is Added's.
func (c *Client) AddedMax(req string, prompt, maxOffload int) error {
	return c.added(req, prompt, max(maxOffload, 0))
}

func (c *Client) added(req string, prompt, maxOffload int) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.reqLocked(req)
	if !ok {
		return fmt.Errorf("client: engine %s: added %q: %w", c.cfg.Engine, req, ErrBadRequestID)
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
// node may hold r from now on.
func (c *Client) announcedLocked(r *mreq) {
	if r != nil && !c.reregister {
		r.atNode = true
	}
}

// appendAdded appends added, with max_offload_tokens when maxOffload ≥ 0.
func appendAdded(b *wire.Batch, req string, prompt, maxOffload int) {
	if maxOffload >= 0 {
		b.AddedMax(req, prompt, maxOffload)
		return
	}
	b.Added(req, prompt)
}

// Hashes announces block hashes hashes[start...] of req (raw bytes; the
// client copies them).
func (c *Client) Hashes(req string, start int, hashes ...[]byte) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.reqLocked(req)
	if !ok {
		return
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
}

// Blocks announces GPU block ids block_ids[group][start...] of req.
func (c *Client) Blocks(req string, group, start int, ids []uint32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.reqLocked(req)
	if !ok {
		return
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
			return
		}
	}
}

// Tokens announces that the KV of tokens [0, computed) is written and
// fenced; total is the sequence length.
func (c *Client) Tokens(req string, computed, total int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.reqLocked(req)
	if !ok {
		return
	}
	if r != nil && r.phase != finished {
		r.computed, r.total, r.hasTokens = computed, total, true
		r.postTok = r.phase == preempted
	}
	c.announcedLocked(r)
	c.batch.Tokens(req, computed, total)
	c.cutLocked()
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
// reused.
func (c *Client) Finished(req string, aborted bool, computed, total int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	r, ok := c.reqLocked(req)
	if !ok {
		return
	}
	c.batch.Finished(req, aborted, computed, total)
	c.cutLocked()
	if r == nil {
		return // the node answers a finished for an unknown request at once; nothing waits here
	}
	c.announcedLocked(r)
	if r.phase == finished {
		return
	}
	r.finPre = r.phase == preempted // its blocks go back with the preemption's release
	r.phase, r.aborted, r.computed, r.total = finished, aborted, computed, total
	r.owed++
	c.freeIfNoNodeLocked(r)
}
