package client

import (
	"encoding/json"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/messages"
)

// Releases: the node's, and those the client answers itself when no node
// can copy a request's blocks.

func (c *Client) onReleased(m *nats.Msg) {
	if c.dropIncoming(m) {
		return
	}
	var rel messages.Released
	if err := json.Unmarshal(m.Data, &rel); err != nil {
		c.cfg.Log.Warn("client: bad released body", "engine", c.cfg.Engine, "body", string(m.Data), "err", err)
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	// A release without an epoch comes from a v1 node, which knows only one.
	if c.closed || (rel.Epoch != "" && (rel.Epoch != c.epoch || rel.Epoch == c.left)) {
		c.st.StaleReleases++
		return
	}
	if c.boot != "" && (rel.Epoch == "" || rel.RSeq == 0) {
		// A v2 node numbers every release: an unnumbered one is no v1
		// node's here, and counted it could mask a lost tail release
		// against the heartbeat's released count.
		c.st.UnnumberedRel++
		c.cfg.Log.Warn("client: release without epoch or rseq from a v2 node; dropped", "engine", c.cfg.Engine,
			"node", c.node, "boot", c.boot, "request", rel.Request, "epoch", rel.Epoch, "rseq", rel.RSeq)
		return
	}
	switch {
	case rel.RSeq == 0: // a v1 session: no rseq to check
	case rel.RSeq <= c.lastRSeq:
		return // a duplicate
	case rel.RSeq > c.lastRSeq+1:
		c.cfg.Log.Warn("client: lost release", "engine", c.cfg.Engine, "epoch", c.epoch, "want_rseq", c.lastRSeq+1,
			"got_rseq", rel.RSeq)
		c.wantResyncLocked(ResyncLostRelease)
	}
	c.lastRSeq = max(c.lastRSeq, rel.RSeq)
	c.relGot++
	if rel.Reason == messages.ReasonEngineGone && (c.reregIn == "" || rel.Epoch != c.reregIn) {
		// The node dropped the engine (an unregister or expiry it saw):
		// everything must be announced again to a fresh registration.
		// Not once a re-register took effect in this epoch: the node
		// holds that registration already (a request's engine_gone comes
		// once its copies end, after the node answered "unknown engine").
		// After this release's own request is answered.
		defer c.forgottenLocked()
	}
	r := c.reqs[rel.Request]
	if r == nil {
		if !c.answersUnknownFinLocked(rel) {
			c.st.UnexpectedRel++
		}
		return
	}
	if rel.Reason == messages.ReasonEngineGone {
		// The node published it once r's copies ended and dropped r: every
		// owed release is answered, and later events of r are freed at once
		// until the engine is registered again (freeIfNoNodeLocked).
		r.atNode, r.silent = false, false
		if r.owed == 0 {
			c.st.UnowedResets++ // a running request: the node drops every one
		}
		c.freeAllLocked(r, Release{Request: rel.Request, Reason: rel.Reason, Epoch: rel.Epoch})
		return
	}
	if r.silent && rel.Reason == messages.ReasonPreempted {
		r.silent = false
		return
	}
	if r.owed == 0 {
		if rel.Reason == messages.ReasonEngineReset {
			// The node reset the current epoch itself (its NATS lapse, or
			// this engine's silence: PROTOCOL.md) and released every
			// request it tracked, running ones too; its resync order
			// comes on another subject. Nothing was owed, nothing frees.
			c.st.UnowedResets++
			return
		}
		c.st.UnexpectedRel++
		return
	}
	c.freeLocked(r, Release{Request: rel.Request, Reason: rel.Reason, Epoch: rel.Epoch})
}

// freeLocked answers one of r's owed releases and hands it to the engine's
// callback (node_lost frees come here only after the lease wait).
func (c *Client) freeLocked(r *mreq, rel Release) {
	r.owed--
	switch {
	case r.phase == finished && r.owed == 0:
		delete(c.reqs, r.id)
	case r.phase != running && r.owed == r.blocksBackAt():
		// This release answers the event that gave the mirrored blocks up
		// (for a request finished while preempted: the preemption, before
		// the finish's release): the engine may reuse them, so no resync
		// may name them again.
		r.clearBlocks()
	}
	c.st.Releases++
	if rel.Reason == messages.ReasonNodeLost {
		c.st.NodeLostFrees++
	}
	c.out.push(rel)
}

// freeAllLocked answers every release r is owed with rel.
func (c *Client) freeAllLocked(r *mreq, rel Release) {
	for r.owed > 0 {
		c.freeLocked(r, rel)
	}
}

// forgottenLocked notes that the node forgot the engine: a re-register is
// due, and the batches until it are discarded, so a request finished or
// preempted in a step no published batch carried (still in the batch, or
// held by an overflow's wait) is one the node holds nothing of, answered
// now as a later event of it would be (freeIfNoNodeLocked), not at a
// register the node may refuse for long.
func (c *Client) forgottenLocked() {
	if !c.reregister {
		c.reregister = true
		for _, r := range c.reqs {
			c.freeIfNoNodeLocked(r)
		}
	}
	c.wake()
}

// freeIfNoNodeLocked frees r at once when no node can copy its blocks: the
// node is lost and the lease wait is over (node_lost); or the node forgot
// the engine (a re-register pending, its batches discarded) and holds
// nothing of r: it released r engine_gone, which it does once r's copies
// ended, or never heard of it (engine_gone, made here). A request the node
// may still hold waits for its own engine_gone: a node answers "unknown
// engine" as soon as it drops the engine, before its copies end.
func (c *Client) freeIfNoNodeLocked(r *mreq) {
	switch {
	case c.lost && c.freedLoss:
		c.freeAllLocked(r, Release{Request: r.id, Reason: messages.ReasonNodeLost})
	case c.reregister && !r.atNode && r.owed > 0:
		c.st.ForgottenFrees += r.owed
		c.freeAllLocked(r, Release{Request: r.id, Reason: messages.ReasonEngineGone})
	}
}

// answersUnknownFinLocked reports whether rel is the node's answer to a
// Finished of this epoch for a request the mirror did not hold
// (unknownFin), and takes that Finished off the count.
func (c *Client) answersUnknownFinLocked(rel messages.Released) bool {
	if rel.Reason != messages.ReasonFinished && rel.Reason != messages.ReasonAborted {
		return false
	}
	n := c.unknownFin[rel.Request]
	switch {
	case n == 0:
		return false
	case n == 1:
		delete(c.unknownFin, rel.Request)
	default:
		c.unknownFin[rel.Request] = n - 1
	}
	return true
}
