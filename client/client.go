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
	"github.com/kvactors/kvactors/sched"
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
	left     string // an epoch left when its node's loss freed its requests; it stays current until the resync
	seq      uint64
	lastRSeq uint64    // highest rseq received in the epoch
	relGot   uint64    // releases received in the epoch
	hbPrev   uint64    // the node's released count at the previous heartbeat of the epoch
	hbPrevAt time.Time // when that reply came (zero: none yet this epoch)
	tailSeq  uint64    // a seq a heartbeat found not applied yet (0: none)
	tailAt   time.Time // when
	batch    wire.Batch
	// unknownFin counts, by request, the epoch's Finished calls for
	// requests the mirror did not hold (never added, or released already):
	// the node answers each with a release at once, which is expected,
	// not UnexpectedRel. Nil until one; dropped with the epoch.
	unknownFin map[string]int
	// reregIn is the epoch in which a re-register took effect: it stays
	// current until the resync, and its late engine_gone releases (the
	// node's, once copies it waited for ended) call for no second one.
	reregIn string
	// full holds the parts of the step's batch already MaxBatchBytes long,
	// oldest first; batch is the part being appended to (cutLocked).
	full []wire.Batch
	body []byte
	// unsent are the requests with events in the step's batch that the
	// node may not hold yet (not atNode): the first publish that may reach
	// it puts them there. A batch dropped unsent told the node nothing.
	unsent map[*mreq]struct{}

	reqs   map[string]*mreq
	loads  map[*loadWait]struct{} // sent, not settled (load.go)
	nextN  uint64
	groups int
	// numBlocks is the spec's num_gpu_blocks: a block id must be below it
	// (0: not checked, for a test's Client without a spec).
	numBlocks int
	// lay is the spec's layout as the node computes it: its MaxHashes and
	// Groups[g].MaxBlocks bound what one request may hold (nil: a spec the
	// node refuses at register, or a test's Client without one: not checked).
	lay    *sched.Layout
	st     Stats
	closed bool

	beforeHeartbeat func() // test hook: runs just before a heartbeat is published
	beforeLoad      func() // test hook: runs in Load before it takes c.mu to send
	afterReregister func() // test hook: runs on the session loop once a re-register took effect

	subs []*nats.Subscription
	kick chan struct{}
	stop chan struct{}
	// connected is told each time the connection is up again (a status
	// listener: the connection is the caller's, and a ReconnectHandler
	// they set stays theirs), so the loop notices a reconnect at once.
	connected chan nats.Status
	wg        sync.WaitGroup
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
	DroppedIncoming  int            // released, stored or resync messages ignored by Config.DropIncoming
	PublishErrors    int            // batches the NATS client refused
	DiscardedBatches int            // not sent: no node (the next resync re-announces them)
	HeldBatches      int            // not sent: a resync is due but waits (an overflow's backoff, or the link is down): it re-announces them
	Resyncs          map[string]int // by reason: the Resync* constants
	NodeLosses       int
	Releases         int    // delivered to OnReleased
	NodeLostFrees    int    // of which reason node_lost
	ForgottenFrees   int    // of which made by the client while the node had forgotten the engine (engine_gone)
	StaleReleases    int    // for an old epoch, or one left when the node's loss freed its requests, or handled after Close began: not a free
	UnnumberedRel    int    // without epoch or rseq in a v2 session (a node with a boot): dropped, not a free
	UnexpectedRel    int    // for a request not waiting for one (but UnowedResets, and the answer to a Finished of one not held)
	UnowedResets     int    // engine_reset or engine_gone of the current epoch for a request owed nothing: the node dropped it running (its lapse, this engine's silence, or it dropped the engine)
	BadRequestIDs    int    // events refused for a request id the protocol does not allow (ErrBadRequestID)
	OutOfRange       int    // events refused for a negative count or start, a group not in the spec, or a block id past its num_gpu_blocks (ErrOutOfRange)
	BadHashes        int    // hashes events refused for an empty hash or one over 64 bytes (ErrBadHash)
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
	if want := InboxPrefix(cfg.Engine); nc.Opts.InboxPrefix != want {
		// The node answers an engine's requests only in its own inbox
		// (PROTOCOL.md "kvactors' choice, replies"): every register would
		// time out, retried until ctx ends, saying nothing.
		return nil, fmt.Errorf("%w: the connection's reply-inbox prefix is %q, want %q "+
			"(nats.CustomInboxPrefix; client.Dial and client.Options set it): the node answers engine %s only there",
			ErrConfig, nc.Opts.InboxPrefix, want, cfg.Engine)
	}
	c := &Client{cfg: cfg, nc: nc, subj: messages.EngineSubject(cfg.Prefix, cfg.Engine, ""), reqs: map[string]*mreq{},
		loads:  map[*loadWait]struct{}{},
		groups: len(cfg.Spec.Groups), numBlocks: cfg.Spec.NumGPUBlocks, kick: make(chan struct{}, 1), stop: make(chan struct{}),
		st: Stats{Resyncs: map[string]int{}}}
	if lay, err := sched.NewLayout(&cfg.Spec); err == nil {
		c.lay = lay
	}
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
	c.connected = nc.StatusChanged(nats.CONNECTED)
	c.wg.Add(1)
	go c.loop()
	return c, nil
}

func newEpoch() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
	return hex.EncodeToString(b[:])
}

// Flush publishes the events announced since the last Flush as one batch
// (one per scheduler step; a step over MaxBatchBytes goes out as several,
// in order). With a resync due it starts the new epoch
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
	pending := c.batch.Events() > 0 || len(c.full) > 0
	if c.lost || c.reregister {
		if pending {
			c.st.DiscardedBatches++
		}
		c.resetBatchLocked()
		return nil
	}
	if c.resync != "" {
		if c.resyncDueLocked(time.Now()) {
			c.resyncLocked()
		} else if pending { // an overflow's wait, or the link is down: the resync re-announces it
			c.st.HeldBatches++
			c.resetBatchLocked()
		}
		return nil
	}
	var err error
	for i := range c.full {
		if err = c.publishLocked(&c.full[i]); err != nil {
			break // the parts after it would follow a gap: the resync re-announces them
		}
	}
	if err == nil && c.batch.Events() > 0 {
		err = c.publishLocked(&c.batch)
	}
	if err != nil {
		c.wantResyncLocked(ResyncPublishError)
	}
	c.resetBatchLocked()
	return nil
}

// resetBatchLocked empties the step's batch, every part of it.
func (c *Client) resetBatchLocked() {
	c.batch.Reset()
	c.full = nil
	clear(c.unsent)
}

// publishLocked sends b under the next seq.
func (c *Client) publishLocked(b *wire.Batch) error {
	c.seq++
	if c.cfg.DropBatch != nil && c.cfg.DropBatch(c.seq) {
		c.st.DroppedBatches++
		c.atNodeLocked() // lost on the way, as far as the client can tell
		return nil
	}
	c.body = b.Body(c.body, c.epoch, c.seq)
	m := &nats.Msg{Subject: c.subj + messages.VerbEvents, Data: c.body}
	if c.cfg.BeforePublish != nil {
		c.cfg.BeforePublish(m, c.seq, b.Events())
	}
	err := c.publishMsg(m)
	if !notSent(err) {
		// Every unsent request, not only b's: a step's later parts, and a
		// resync's, are about to follow it, and an extra atNode only waits.
		c.atNodeLocked()
	}
	if err != nil {
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
// live request (PROTOCOL.md "Resync"). If a batch cannot be published, no
// later one is (they would follow a gap the node never fills: checklist
// step 9) and another resync is due.
func (c *Client) resyncLocked() {
	c.st.Resyncs[c.resync]++
	c.cfg.Log.Info("client: resync", "engine", c.cfg.Engine, "reason", c.resync, "old_epoch", c.epoch,
		"old_seq", c.seq, "requests", len(c.reqs))
	c.resync, c.holdUntil = "", time.Time{}
	c.epoch, c.seq, c.lastRSeq, c.relGot, c.hbPrev, c.hbPrevAt = newEpoch(), 0, 0, 0, 0, time.Time{}
	c.tailSeq, c.unknownFin = 0, nil
	c.resetBatchLocked()
	var err error
	c.reannounceLocked(func() {
		if err != nil {
			c.batch.Reset() // past a failed publish: the retry re-announces it
		} else if c.batch.Len() >= c.cfg.MaxBatchBytes {
			err = c.publishLocked(&c.batch)
			c.batch.Reset()
		}
	})
	if err == nil && c.batch.Events() > 0 {
		err = c.publishLocked(&c.batch)
	}
	c.resetBatchLocked()
	if err != nil {
		c.resync = ResyncRetry // a publish failed: start over with yet another epoch
	}
}

// reannounceLocked appends every mirrored request to the batch, oldest
// first, calling flush between events (mreq.announce), and marks each
// preempted request that owes nothing to absorb the release its
// re-announced preempted will get.
func (c *Client) reannounceLocked(flush func()) {
	reqs := make([]*mreq, 0, len(c.reqs))
	for _, r := range c.reqs {
		reqs = append(reqs, r)
	}
	slices.SortFunc(reqs, func(a, b *mreq) int { return int(a.n - b.n) })
	for _, r := range reqs {
		r.silent = r.phase == preempted && r.owed == 0
		c.announcedLocked(r)
		r.announce(&c.batch, flush)
	}
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
// while an overflow's wait lasts (holdLocked), nor while the connection is
// down: its batches would be refused, and every try starts another epoch
// and re-announces every live request on the engine's step. The
// reconnect's CONNECTED status wakes the loop, which starts it then.
func (c *Client) resyncDueLocked(now time.Time) bool {
	return c.resync != "" && !now.Before(c.holdUntil) && c.nc.IsConnected()
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
