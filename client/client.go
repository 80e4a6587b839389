package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/wire"
)

// Client is one engine's session with its kvactors node. Create it with
// Connect; end it with Close.
type Client struct {
	cfg  Config
	nc   *nats.Conn
	subj string // P.E. (messages.EngineSubject with no verb)
	out  *dispatcher

	mu sync.Mutex
	// The node that answered the last register, and its lease.
	node, boot string
	lease      time.Duration
	lastSeen   time.Time // last hello, heartbeat or reply of node/boot
	lost       bool      // the node is lost: frees wait for freeAtLocked, then re-register
	freedLoss  bool      // the node_lost frees of this loss are done
	otherBoot  bool      // a newer boot of node answered: this boot's process is gone
	// pastBoots are boots of node known to be gone (the latest few): ones
	// this engine registered with before boot, and ones a probe showed older
	// than a boot that answered. A late message of one is no news (boots.go).
	pastBoots []string
	// suspects are other boots of node seen in messages that prove nothing,
	// each with the probe count when first seen: a reply to a later probe
	// settles it (boots.go).
	suspects   map[string]uint64
	probes     uint64 // requests numbered by probeLocked
	regAt      uint64 // probes when the last register took effect
	reregister bool   // the node forgot the engine: register again, then resync
	resync     string // a resync is due, for this reason ("" = none)
	// An overflow resync waits until holdUntil; overflows counts those
	// less than a lease apart, lastOverflow the latest.
	holdUntil    time.Time
	overflows    int
	lastOverflow time.Time
	reconnects   uint64 // nc.Stats().Reconnects last seen
	sent         sends  // when it last published to the node (sends.go); its own lock

	epoch    string
	seq      uint64
	lastRSeq uint64    // highest rseq received in the epoch
	relGot   uint64    // releases received in the epoch
	hbPrev   uint64    // the node's released count at the previous heartbeat of the epoch
	hbPrevAt time.Time // when that reply came (zero: none yet this epoch)
	tailSeq  uint64    // a seq a heartbeat found not applied yet (0: none)
	tailAt   time.Time // when
	batch    wire.Batch
	body     []byte

	reqs   map[string]*mreq
	loads  map[*loadWait]struct{} // sent, not settled (load.go)
	nextN  uint64
	groups int
	st     Stats
	closed bool

	beforeHeartbeat func() // test hook: runs just before a heartbeat is published
	beforeLoad      func() // test hook: runs in Load before it takes c.mu to send

	subs []*nats.Subscription
	kick chan struct{}
	stop chan struct{}
	wg   sync.WaitGroup
}

// Why a resync started: the keys of Stats.Resyncs and the "reason" of the
// client's resync log line.
const (
	ResyncNode         = "resync"        // the node's P.E.resync (a gap, overflow or its reconnect)
	ResyncLostRelease  = "lost_release"  // an rseq gap, or fewer releases than a heartbeat reply counted
	ResyncLostTail     = "lost_tail"     // a batch still unapplied a heartbeat period on, no resync came
	ResyncNewBoot      = "new_boot"      // registered again after the node was lost
	ResyncReregister   = "reregister"    // registered again after the node forgot the engine
	ResyncReconnect    = "reconnect"     // the client's own NATS connection reconnected
	ResyncPublishError = "publish_error" // the NATS client refused a batch
	ResyncEngine       = "engine"        // Client.Resync
	ResyncRetry        = "retry"         // a resync's own batch could not be published
)

// Stats counts what the client did; Stats() returns a copy.
type Stats struct {
	Epoch            string
	Seq              uint64
	Node, Boot       string
	Registers        int
	Batches          int
	DroppedBatches   int            // by Config.DropBatch
	PublishErrors    int            // batches the NATS client refused
	DiscardedBatches int            // not sent: no node (the next resync re-announces them)
	HeldBatches      int            // not sent: an overflow resync's wait (it re-announces them)
	Resyncs          map[string]int // by reason: the Resync* constants
	NodeLosses       int
	Releases         int    // delivered to OnReleased
	NodeLostFrees    int    // of which reason node_lost
	ForgottenFrees   int    // of which made by the client while the node had forgotten the engine (engine_gone)
	StaleReleases    int    // for an old epoch: not a free
	UnnumberedRel    int    // without epoch or rseq in a v2 session (a node with a boot): dropped, not a free
	UnexpectedRel    int    // for a request not waiting for one
	BadRequestIDs    int    // events refused for a request id the protocol does not allow (ErrBadRequestID)
	Live             int    // requests mirrored
	Awaiting         int    // requests waiting for a release
	RegisterRefusals int    // re-registers the node refused (Config.OnRegisterRefused)
	RegisterRefused  string // the latest refusal while the session waits to register ("" once registered)
	BootsSuspected   int    // other boots of the node seen in messages that prove nothing, then probed (boots.go)
	BootsStale       int    // of which a probe showed older than a boot that answered: no restart
	LoadsInDoubt     int    // loads now in doubt: no reply yet, their blocks not to be reused (LoadInDoubtError)
	LateLoadReplies  int    // loads in doubt settled by their own late reply
}

// Connect subscribes, registers cfg.Spec (retrying with backoff while no
// node answers, or one answers that its intake is full, until ctx ends)
// and starts the session. A register the node refuses is returned as an
// error at once.
func Connect(ctx context.Context, nc *nats.Conn, cfg Config) (*Client, error) {
	cfg, err := cfg.withDefaults()
	if err != nil {
		return nil, err
	}
	c := &Client{cfg: cfg, nc: nc, subj: messages.EngineSubject(cfg.Prefix, cfg.Engine, ""), reqs: map[string]*mreq{},
		loads:  map[*loadWait]struct{}{},
		groups: len(cfg.Spec.Groups), kick: make(chan struct{}, 1), stop: make(chan struct{}),
		st: Stats{Resyncs: map[string]int{}}}
	c.epoch = newEpoch()
	c.reconnects = nc.Stats().Reconnects
	c.out = newDispatcher(cfg.OnReleased, cfg.OnStored, cfg.OnRegisterRefused)
	if err := c.subscribe(); err != nil {
		c.unsubscribe()
		c.out.close()
		return nil, err
	}
	if err := c.registerRetry(ctx); err != nil {
		c.unsubscribe()
		c.out.close()
		return nil, err
	}
	c.wg.Add(1)
	go c.loop()
	return c, nil
}

func newEpoch() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

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
	if _, ok := c.reqLocked(req); !ok {
		return fmt.Errorf("client: engine %s: added %q: %w", c.cfg.Engine, req, ErrBadRequestID)
	}
	r, ok := c.reqs[req]
	if !ok {
		c.nextN++
		r = &mreq{id: req, n: c.nextN, prompt: prompt, maxOffload: maxOffload, blocks: make([][]uint32, c.groups)}
		c.reqs[req] = r
	}
	c.announcedLocked(r)
	appendAdded(&c.batch, req, prompt, maxOffload)
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
	for _, h := range hashes {
		c.batch.Hash(h)
	}
	c.batch.EndHashes()
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
	c.batch.Blocks(req, group, start, ids)
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

// Flush publishes the events announced since the last Flush as one batch
// (one per scheduler step). With a resync due it starts the new epoch
// instead, which re-announces those events too. Without a node the batch
// is discarded: the resync after re-registering re-announces it. A batch
// the NATS client refuses (reconnecting, with no reconnect buffer: Options)
// is lost like any other: it is counted in Stats.PublishErrors and a
// resync is due. Flush fails only after Close.
func (c *Client) Flush() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return fmt.Errorf("client: engine %s: flush after Close", c.cfg.Engine)
	}
	if c.lost || c.reregister {
		if c.batch.Events() > 0 {
			c.st.DiscardedBatches++
		}
		c.batch.Reset()
		return nil
	}
	if c.resync != "" {
		if c.resyncDueLocked(time.Now()) {
			c.resyncLocked()
		} else if c.batch.Events() > 0 { // an overflow's wait: the resync re-announces it
			c.st.HeldBatches++
			c.batch.Reset()
		}
		return nil
	}
	if c.batch.Events() == 0 {
		return nil
	}
	if err := c.publishLocked(); err != nil {
		c.wantResyncLocked(ResyncPublishError)
	}
	c.batch.Reset()
	return nil
}

// publishLocked sends the batch under the next seq.
func (c *Client) publishLocked() error {
	c.seq++
	if c.cfg.DropBatch != nil && c.cfg.DropBatch(c.seq) {
		c.st.DroppedBatches++
		return nil
	}
	c.body = c.batch.Body(c.body, c.epoch, c.seq)
	m := &nats.Msg{Subject: c.subj + messages.VerbEvents, Data: c.body}
	if c.cfg.BeforePublish != nil {
		c.cfg.BeforePublish(m, c.seq, c.batch.Events())
	}
	if err := c.publishMsg(m); err != nil {
		c.st.PublishErrors++
		c.cfg.Log.Debug("client: publish", "engine", c.cfg.Engine, "seq", c.seq, "err", err)
		return fmt.Errorf("client: engine %s: publish batch %d: %w", c.cfg.Engine, c.seq, err)
	}
	c.st.Batches++
	return nil
}

// publishMsg publishes m to the node, recorded in c.sent.
func (c *Client) publishMsg(m *nats.Msg) error {
	id := c.sent.begin(time.Now())
	err := c.nc.PublishMsg(m)
	c.sent.end(id, err)
	return err
}

// resyncLocked starts a new epoch whose first batches re-announce every
// live request (PROTOCOL.md "Resync"). If a batch cannot be published,
// another resync is due.
func (c *Client) resyncLocked() {
	c.st.Resyncs[c.resync]++
	c.cfg.Log.Info("client: resync", "engine", c.cfg.Engine, "reason", c.resync, "old_epoch", c.epoch,
		"old_seq", c.seq, "requests", len(c.reqs))
	c.resync, c.holdUntil = "", time.Time{}
	c.epoch, c.seq, c.lastRSeq, c.relGot, c.hbPrev, c.hbPrevAt = newEpoch(), 0, 0, 0, 0, time.Time{}
	c.tailSeq = 0
	c.batch.Reset()
	var err error
	size := 0
	c.reannounceLocked(func(n int) {
		if size += n; size >= c.cfg.MaxBatchBytes {
			err = firstErr(err, c.publishLocked())
			c.batch.Reset()
			size = 0
		}
	})
	if c.batch.Events() > 0 {
		err = firstErr(err, c.publishLocked())
		c.batch.Reset()
	}
	if err != nil {
		c.resync = ResyncRetry // a publish failed: start over with yet another epoch
	}
}

// reannounceLocked appends every mirrored request to the batch, oldest
// first, calling flush between events (mreq.announce), and marks each
// preempted request that owes nothing to absorb the release its
// re-announced preempted will get.
func (c *Client) reannounceLocked(flush func(bytes int)) {
	reqs := make([]*mreq, 0, len(c.reqs))
	for _, r := range c.reqs {
		reqs = append(reqs, r)
	}
	slices.SortFunc(reqs, func(a, b *mreq) int { return int(a.n - b.n) })
	for _, r := range reqs {
		r.silent = r.phase == preempted && r.owed == 0
		r.atNode = true
		r.announce(&c.batch, flush)
	}
}

func firstErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// Stats returns a copy of the counters.
func (c *Client) Stats() Stats {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.st
	s.Resyncs = make(map[string]int, len(c.st.Resyncs))
	for k, v := range c.st.Resyncs {
		s.Resyncs[k] = v
	}
	s.Epoch, s.Seq, s.Node, s.Boot, s.Live = c.epoch, c.seq, c.node, c.boot, len(c.reqs)
	for _, r := range c.reqs {
		if r.owed > 0 {
			s.Awaiting++
		}
	}
	return s
}

// Live reports whether the session is up: registered with a node not
// known to be lost, with no re-register or resync pending.
func (c *Client) Live() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return !c.closed && !c.lost && !c.reregister && c.resync == ""
}

// Epoch is the current epoch.
func (c *Client) Epoch() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.epoch
}

// Resync asks for a new epoch at the next Flush (or heartbeat tick).
func (c *Client) Resync() {
	c.mu.Lock()
	c.wantResyncLocked(ResyncEngine)
	c.mu.Unlock()
}

// resyncDueLocked reports whether a resync is due and may start now: not
// while an overflow's wait lasts (holdLocked).
func (c *Client) resyncDueLocked(now time.Time) bool {
	return c.resync != "" && !now.Before(c.holdUntil)
}

func (c *Client) wantResyncLocked(reason string) {
	if c.resync == "" {
		c.resync = reason
	}
	c.wake()
}

func (c *Client) wake() {
	select {
	case c.kick <- struct{}{}:
	default:
	}
}
