package client

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/tracing/natsheader"
)

var (
	// ErrLoadInDoubt is what a LoadInDoubtError matches with errors.Is.
	ErrLoadInDoubt = errors.New("load in doubt: the node may still write its destination blocks")
	// ErrNoNode: the session has no node to send to: its node is lost, or
	// (Load only) forgot the engine, and no node has answered a register
	// since; Load and Lookup send nothing meanwhile.
	ErrNoNode = errors.New("no node: the session's node is lost or forgot the engine")
)

// LoadInDoubtError is Load's error when the load was sent but no reply came
// before RequestTimeout or the caller's ctx ended. The node never abandons
// a load: it may still be copying into the destination blocks, or start
// later. The engine must not reuse those blocks, nor load into them again,
// until Settled is closed.
type LoadInDoubtError struct {
	Request    string
	Node, Boot string // the node the load was sent to
	Err        error  // why Load stopped waiting
	settled    <-chan struct{}
}

func (e *LoadInDoubtError) Error() string {
	return fmt.Sprintf("client: load %s: no reply from node %s (%v): its destination blocks may still be "+
		"written until Settled", e.Request, e.Node, e.Err)
}

func (e *LoadInDoubtError) Unwrap() []error { return []error{ErrLoadInDoubt, e.Err} }

// Settled is closed once the destination blocks are safe to reuse: the
// load's own reply came (late: whatever it says, the node is done with
// it); or its node was lost and the loss's frees were done (a lease after
// the later of its last sign of life and the client's last publish to it:
// the node's fencing lets no copy run past that), if a flush after the
// load came back (else the request may still sit in the connection's
// reconnect buffer, to reach a node that is alive after all); or another
// boot of that node answered the engine's register (its old process can
// copy nothing; another boot seen in any other reply makes the node lost,
// and the load settles with that loss's frees, a lease later, reached NATS
// or not: a restart that overlapped its old process would still be
// fenced); or Close's
// unregister was answered by that node (it waits for loads in flight).
// Only the session's node is watched: once another node answers a
// register (a cluster), a load in doubt at the old one settles only by its
// own reply. Nothing else proves it: a heartbeat or status round trip after the reply
// would have come is no proof, since loads run beside the node's other
// work. After Close the client stops watching, so a load still in doubt
// then stays so until the engine's process (and its mappings) ends.
func (e *LoadInDoubtError) Settled() <-chan struct{} { return e.settled }

// loadWait is one load sent and not yet settled (its reply, a loss of its
// node or Close's unregister). Fields other than the channel are under c.mu.
type loadWait struct {
	node, boot string
	probe      uint64 // its number as a probe (boots.go)
	sub        *nats.Subscription
	settled    chan struct{}
	rep        *nats.Msg          // the reply, once it came
	reply      messages.LoadReply // rep decoded (loadReplied), unless replyErr
	replyErr   error
	done       bool // settled
	doubt      bool // Load gave up waiting: counted in Stats.LoadsInDoubt
	// atServer: a flush after the publish came back, so the request left
	// this client: none of it waits in the connection's reconnect buffer,
	// to reach the node after the node was given up for lost.
	atServer bool
}

// Load copies the first numTokens tokens' chunks of a prompt with these
// hashes into blocks (per group, blocks_per_chunk ids per chunk; id 0 is
// skipped) and returns once the copies completed. The request carries the
// W3C trace context of ctx, if any (the node's kvactors.load span is a
// child of the caller's). The count it returns is
// numTokens echoed, but group g receives only chunks [0, numTokens /
// tokens_per_chunk[g]), no part of one: take numTokens from Lookup (with
// groups of different tokens_per_chunk, rounded down to a multiple of every
// group's), or recompute from the least whole-chunk boundary over the
// groups; the tokens past numTokens are the engine's to compute (docs/
// PROTOCOL.md, "What a load writes"). An error matching
// ErrLoadInDoubt (a *LoadInDoubtError) means no reply came: see its
// Settled for when the blocks may be reused. Any other error means the
// node wrote nothing it will still write (it answered, or the load was
// never sent). While the node is lost, or has forgotten the engine (a
// re-register pending), Load sends nothing (ErrNoNode), nor once ctx is
// done (ctx's error).
func (c *Client) Load(ctx context.Context, req string, hashes []string, numTokens int, blocks [][]int64) (int, error) {
	data, err := json.Marshal(messages.LoadRequest{Request: req, Hashes: hashes, NumTokens: numTokens, Blocks: blocks})
	if err != nil {
		return 0, fmt.Errorf("client: encode load: %w", err)
	}
	c.mu.Lock()
	err = c.loadRefusedLocked(req)
	c.mu.Unlock()
	if err != nil {
		return 0, err
	}
	w := &loadWait{settled: make(chan struct{})}
	// An inbox of its own, kept after Load gives up, so a late reply still
	// settles the load.
	w.sub, err = c.nc.Subscribe(c.nc.NewInbox(), func(m *nats.Msg) { c.loadReplied(w, m) })
	if err != nil {
		return 0, fmt.Errorf("client: engine %s: load %s: subscribe reply inbox: %w", c.cfg.Engine, req, err)
	}
	m := &nats.Msg{Subject: c.subj + messages.VerbLoad, Reply: w.sub.Subject, Data: data}
	natsheader.InjectSpan(ctx, m)
	if c.beforeLoad != nil {
		c.beforeLoad()
	}
	// Checked again, recorded and published under the lock a loss and a
	// register take: a load is either refused or sent to the boot it names
	// before that boot is given up, so the loss's fence covers it and its
	// settle finds it. (Published under c.mu as batches are: it buffers.)
	c.mu.Lock()
	if err := c.loadRefusedLocked(req); err != nil {
		c.mu.Unlock()
		_ = w.sub.Unsubscribe()
		return 0, err
	}
	if err := ctx.Err(); err != nil {
		// Sent now, it would only come back in doubt, its blocks held.
		c.mu.Unlock()
		_ = w.sub.Unsubscribe()
		return 0, fmt.Errorf("client: engine %s: load %s not sent: %w", c.cfg.Engine, req, err)
	}
	w.node, w.boot, w.probe = c.node, c.boot, c.probeLocked()
	c.loads[w] = struct{}{}
	if err := c.publishMsg(m); err != nil {
		c.settleLoadLocked(w) // never sent
		c.mu.Unlock()
		return 0, fmt.Errorf("client: engine %s: load %s: %w", c.cfg.Engine, req, err)
	}
	c.mu.Unlock()
	wait, cancel := context.WithTimeout(ctx, c.cfg.RequestTimeout)
	defer cancel()
	if err := c.nc.FlushWithContext(wait); err == nil {
		c.mu.Lock()
		w.atServer = true
		c.mu.Unlock()
	}
	select {
	case <-w.settled:
	case <-wait.Done():
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case w.rep != nil:
		return c.loadResult(w, req)
	case w.done: // the node was lost (after its lease) or the client closed
		return 0, fmt.Errorf("client: engine %s: load %s: %w before its reply; its blocks are safe", c.cfg.Engine,
			req, ErrNoNode)
	}
	w.doubt = true
	c.st.LoadsInDoubt++
	c.cfg.Log.Warn("client: load in doubt", "engine", c.cfg.Engine, "request", req, "node", w.node, "err", wait.Err())
	return 0, &LoadInDoubtError{Request: req, Node: w.node, Boot: w.boot, Err: wait.Err(), settled: w.settled}
}

// loadRefusedLocked is why no load may be sent now, if so: after Close;
// while the node is lost (its fence covers only loads sent before); or
// while a re-register is pending (the node forgot the engine, so it would
// only answer "unknown engine"). Registers are sent only while one of those
// two holds, so every load reached NATS before every register of the
// round: a newer boot answering one took the load, if at all, before it
// knew the engine, and copied nothing; its reply may settle the load. A
// load sent after that register could reach the new boot once it knows the
// engine and copy while the reply told the engine its blocks were safe.
func (c *Client) loadRefusedLocked(req string) error {
	switch {
	case c.closed:
		return fmt.Errorf("client: engine %s: load %s after Close", c.cfg.Engine, req)
	case c.lost:
		return fmt.Errorf("client: engine %s: load %s: %w (node %s)", c.cfg.Engine, req, ErrNoNode, c.node)
	case c.reregister:
		return fmt.Errorf("client: engine %s: load %s: %w (node %s forgot the engine; registering again)",
			c.cfg.Engine, req, ErrNoNode, c.node)
	}
	return nil
}

// loadResult reads w's reply. Caller holds c.mu.
func (c *Client) loadResult(w *loadWait, req string) (int, error) {
	m, rep := w.rep, &w.reply
	if len(m.Data) == 0 && m.Header.Get("Status") == "503" {
		return 0, fmt.Errorf("client: engine %s: load %s: %w", c.cfg.Engine, req, nats.ErrNoResponders)
	}
	if w.replyErr != nil {
		return 0, fmt.Errorf("client: engine %s: decode load reply %q: %w", c.cfg.Engine, m.Data, w.replyErr)
	}
	c.repliedLocked(rep.Node, rep.Boot, w.probe)
	if rep.Error != "" || !rep.OK {
		return 0, fmt.Errorf("client: engine %s: load %s: %s", c.cfg.Engine, req, rep.Error)
	}
	return rep.LoadedTokens, nil
}

// loadReplied is the reply inbox's handler: a reply of the node the load
// was sent to (an error, or no responders, included; from another boot of
// it too, whose old process can copy nothing more) means the node is done
// with the load. A reply that names another node is not that node's word
// and is passed over: on a cluster every node
// receives the engine's load, and a reply from one that does not serve it
// would settle a load its own node may still be copying into (the nodes
// answer only the engine's own; this does not depend on it).
func (c *Client) loadReplied(w *loadWait, m *nats.Msg) {
	// Decoded once, here: loadResult reads what this keeps. A body that does
	// not decode names no one: the node's word (loadResult reports it).
	var rep messages.LoadReply
	err := json.Unmarshal(m.Data, &rep)
	c.mu.Lock()
	defer c.mu.Unlock()
	if w.done {
		return
	}
	if err == nil && rep.Node != "" && rep.Node != w.node { // another boot of the node: the old one can copy nothing more
		c.cfg.Log.Warn("client: a load's reply from a node it was not sent to is ignored", "engine", c.cfg.Engine,
			"node", rep.Node, "boot", rep.Boot, "sent_to", w.node)
		return
	}
	w.rep, w.reply, w.replyErr = m, rep, err
	if w.doubt {
		// Its Load returned already: loadResult will not read this reply,
		// whose boot may still be news (step 19: another boot is a loss).
		if err == nil {
			c.repliedLocked(rep.Node, rep.Boot, w.probe)
		}
		c.st.LateLoadReplies++
		c.cfg.Log.Info("client: a load in doubt was answered: its blocks are safe", "engine", c.cfg.Engine,
			"node", w.node)
	}
	c.settleLoadLocked(w)
}

// settleLoadLocked ends w: its blocks are safe, nothing more is awaited.
func (c *Client) settleLoadLocked(w *loadWait) {
	if w.done {
		return
	}
	w.done = true
	delete(c.loads, w)
	if w.doubt {
		c.st.LoadsInDoubt--
	}
	_ = w.sub.Unsubscribe()
	close(w.settled)
}

// settleLoadsOfLocked settles every load sent to node/boot: the node is
// done with all of them (lost past its lease, or unregistered). On a loss
// (reachedOnly) a load not known to have left this client stays in doubt:
// if the engine's own link dropped, the request may sit in the reconnect
// buffer and reach a node that is alive after all, whose fence never
// lapsed. An unregister's answer settles every one: the unregister went
// out on the same connection after them.
func (c *Client) settleLoadsOfLocked(node, boot string, reachedOnly bool) {
	for w := range c.loads {
		if w.node == node && w.boot == boot && (w.atServer || !reachedOnly) {
			c.settleLoadLocked(w)
		}
	}
}

// stopWatchingLoadsLocked drops the reply inboxes of loads not settled
// (Close): they stay in doubt.
func (c *Client) stopWatchingLoadsLocked() {
	for w := range c.loads {
		_ = w.sub.Unsubscribe()
		delete(c.loads, w)
	}
}
