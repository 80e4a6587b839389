package node

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/actors/engine"
	"github.com/kvactors/kvactors/hostpool"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
)

// subscribe wires every inbound protocol subject (P.<engine>.<verb>) into
// the ingester through one subscription, so one engine's messages keep their
// order across verbs. Half of --max-pending-bytes bounds nats.go's pending
// queue for it (it holds only what the fast handler has not yet taken), half
// the ingester's shard queues (where work waits for the decode workers, and
// where a refusal can be attributed to its engine).
func (n *Node) subscribe() error {
	natsBudget := n.cfg.MaxPendingBytes / 2
	n.ingest = newIngester(n, n.cfg.DecodeWorkers, n.cfg.MaxPendingBytes-natsBudget)
	subject := n.cfg.Prefix + ".*.*"
	s, err := n.nc.Subscribe(subject, n.ingest.take)
	if err != nil {
		return fmt.Errorf("subscribe %s: %w", subject, err)
	}
	// nats.go counts a message before it drops it for the limit: keep one
	// largest message of headroom so its pending bytes never pass its half.
	// It counts a message's body and headers only, not the Msg it keeps
	// for it nor its subject and reply (up to the server's control line),
	// so a flood of empty messages would ride in almost free: the count is
	// bounded too, as if each cost natsMsgCost.
	if err := s.SetPendingLimits(natsPendingMsgs(natsBudget, n.controlLine()), int(natsBudget-n.nc.MaxPayload())); err != nil {
		return fmt.Errorf("pending limits of %s: %w", subject, err)
	}
	n.subs = append(n.subs, s)
	n.ingest.sub = s
	n.intakeSub.Store(s)
	in := n.ingest
	n.slow.add(func(dropped *nats.Subscription) bool {
		if dropped != s {
			return false
		}
		in.loseAll() // batches lost: every engine resyncs
		return true
	})
	n.fence.OnLapseEnding(n.ingest.markLapseEnd)
	if err := n.nc.Flush(); err != nil {
		return fmt.Errorf("flush subscriptions: %w", err)
	}
	return nil
}

// intakeDropped is the messages nats.go has dropped from the intake's
// subscription (a slow consumer: past its pending limits), 0 before it is
// made. Read at scrape time: nats.go reports a slow consumer once per
// episode, however many messages it then drops.
func (n *Node) intakeDropped() int64 {
	s := n.intakeSub.Load()
	if s == nil {
		return 0
	}
	d, err := s.Dropped()
	if err != nil { // closed: its count is gone with it
		return 0
	}
	return int64(d)
}

// IntakePeak is the most inbound bytes the node has held at once: the peak
// of its own queues plus the peak of nats.go's pending queue for the
// subscription, in the bytes nats.go counts (bodies and headers; each
// message's own cost, subject and reply are bounded by its message count
// instead). It never exceeds --max-pending-bytes.
func (n *Node) IntakePeak() int64 {
	peak := n.ingest.peak.Load()
	if len(n.subs) > 0 {
		if _, b, err := n.subs[0].MaxPending(); err == nil {
			peak += int64(b)
		}
	}
	return peak
}

// replyError answers a request/reply message with {"error", node, boot}
// (no-op without a reply subject).
func (n *Node) replyError(ctx context.Context, reply string, err error) {
	n.outbox.Reply(ctx, reply, n.errorReply(err))
}

// errorReply is every verb's error reply, status included:
// {"error","node","boot"} and nothing else (messages.ErrorReply).
func (n *Node) errorReply(err error) messages.ErrorReply {
	return messages.ErrorReply{Error: errorText(err), Node: n.cfg.NodeID, Boot: n.boot}
}

// maxErrorText bounds an error reply's text: a reply past the server's
// max_payload would be refused and the requester left without an answer.
const maxErrorText = 4 << 10

// errorText is err's text, cut at maxErrorText bytes (at a rune boundary).
func errorText(err error) string {
	s := err.Error()
	if len(s) <= maxErrorText {
		return s
	}
	cut := maxErrorText
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "… (cut)"
}

// onRegister handles P.E.register taken off NATS at at. On a cluster the
// claim waits on JetStream (for up to a lease when it stalls), so it is
// returned as a step that the intake runs off its shard worker, with the
// engine's later messages parked behind it (ingester.park); nil when the
// register is done.
func (n *Node) onRegister(engineID string, m *nats.Msg, at time.Time) *claimStep {
	ctx := n.msgCtx(m)
	spec, err := ingest.DecodeSpec(m.Data, n.cfg.Limits)
	if err == nil {
		// Segment names before anything looks at them (PROTOCOL.md
		// "Isolation"), on every node alike: on a cluster the claim asks
		// whether the names exist on this host (localMemory), and a claim
		// made for a name another engine owns would tell the sender, by
		// which node answers, on which host that name exists
		// (docs/SECURITY.md). register checks it again.
		if err = ingest.CheckOwner(engineID, &spec); err != nil {
			err = fmt.Errorf("%w: %w", ErrRegister, err)
		}
	}
	if err == nil && n.cl != nil {
		err = n.locatable(spec)
	}
	if err == nil && n.cl != nil {
		return n.registerClaimed(ctx, engineID, spec, m.Reply, at)
	}
	if err == nil {
		err = n.register(engineID, spec, at)
	}
	n.answerRegister(ctx, engineID, m.Reply, err)
	return nil
}

// answerRegister answers a register: ok, or the error that refused it.
func (n *Node) answerRegister(ctx context.Context, engineID, reply string, err error) {
	if err != nil {
		reason := messages.RejectBadSpec
		if errors.Is(err, ErrLimit) {
			reason = messages.RejectLimit
		}
		n.rejected(reason, "register refused", "engine", engineID, "err", err)
		n.replyError(ctx, reply, err)
		return
	}
	n.outbox.Reply(ctx, reply, messages.RegisterReply{OK: true, Node: n.cfg.NodeID, Boot: n.boot,
		LeaseMS: n.cfg.Lease.Milliseconds()})
}

// onHeartbeat hands P.E.heartbeat to the engine actor, which answers it after
// every batch the engine sent before it.
func (n *Node) onHeartbeat(engineID string, m *nats.Msg, hearing uint64) {
	ctx := n.msgCtx(m)
	rec := n.engine(engineID)
	if rec == nil {
		n.rejectedUnknownEngine("heartbeat of an unregistered engine", engineID)
		n.replyError(ctx, m.Reply, fmt.Errorf("%w %q", errUnknownEngine, engineID))
		return
	}
	hb, err := ingest.DecodeHeartbeat(m.Data)
	if err != nil {
		n.rejected(messages.RejectMalformed, "heartbeat refused", "engine", engineID, "err", err)
		n.replyError(ctx, m.Reply, err)
		return
	}
	n.system.Root.Send(rec.pid, &engine.Heartbeat{Epoch: hb.Epoch, Seq: hb.Seq, Reply: m.Reply, Ctx: ctx,
		HearingGen: hearing, Stamped: true})
}

// StatusReply is the body of a P.E.status reply. Error is set only in
// /debug/engines' list, for an engine that did not answer: a P.E.status
// error reply is messages.ErrorReply.
type StatusReply struct {
	engine.Status
	Pool hostpool.Stats `json:"pool"`
	StatusPage
	Error string `json:"error,omitempty"`
	Node  string `json:"node"`
	Boot  string `json:"boot"`
}

// Status gathers one engine's snapshot (also served on /debug/engines).
func (n *Node) Status(engineID string, timeout time.Duration) (StatusReply, error) {
	return n.startStatus(engineID)(timeout)
}

// startStatus sends the engine actor a status query now (so the answer
// reflects every message handled before) and returns the wait for it.
func (n *Node) startStatus(engineID string) func(timeout time.Duration) (StatusReply, error) {
	rec := n.engine(engineID)
	if rec == nil {
		return func(time.Duration) (StatusReply, error) {
			return StatusReply{}, fmt.Errorf("%w %q", errUnknownEngine, engineID)
		}
	}
	ch := make(chan engine.Status, 1)
	n.system.Root.Send(rec.pid, &engine.StatusQuery{Reply: ch})
	return func(timeout time.Duration) (StatusReply, error) {
		select {
		case st := <-ch:
			return StatusReply{Status: st, Pool: n.poolStats(),
				StatusPage: StatusPage{Pages: 1, TotalRequests: len(st.Requests)}, Node: n.cfg.NodeID, Boot: n.boot}, nil
		case <-time.After(timeout):
			return StatusReply{}, fmt.Errorf("engine %q did not answer status within %v", engineID, timeout)
		}
	}
}

// Engines lists registered engine ids.
func (n *Node) Engines() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	ids := make([]string, 0, len(n.engines))
	for id := range n.engines {
		ids = append(ids, id)
	}
	return ids
}

// maxStatusGathers bounds the P.E.status requests the node gathers at
// once: each costs a goroutine for up to 2 s and work in proportion to its
// engine's requests, and a status message's bytes leave the intake budget
// at once. Past it a request is refused (limit), answered with the error.
const maxStatusGathers = 64

// maxStatusGathersPerEngine bounds one engine's share of them: a gather of
// an engine with many live requests takes seconds, and one engine asking
// without pause would otherwise hold every slot, and the others' status
// would be refused.
const maxStatusGathersPerEngine = 4

// onStatus answers P.E.status. The query reaches the engine actor after
// every batch the engine sent before it; the answer is awaited off the
// ingest worker so a slow gather never holds up events.
func (n *Node) onStatus(engineID string, m *nats.Msg) {
	page, err := decodeStatusQuery(m.Data)
	if err != nil {
		n.rejected(messages.RejectLabel(err), "status request refused", "engine", engineID, "err", err)
		n.replyError(context.Background(), m.Reply, err)
		return
	}
	rec := n.engine(engineID)
	if rec == nil {
		err := fmt.Errorf("%w %q", errUnknownEngine, engineID)
		n.rejected(messages.RejectUnknownEngine, "status of an unregistered engine", "engine", engineID)
		n.replyError(context.Background(), m.Reply, err)
		return
	}
	refuse := func(err error) {
		n.rejected(messages.RejectLimit, "status request refused", "engine", engineID, "err", err)
		n.replyError(context.Background(), m.Reply, err)
	}
	release, err := n.takeStatusSlot(rec)
	if err != nil {
		refuse(err)
		return
	}
	wait := n.startStatus(engineID)
	go func() {
		defer release()
		st, err := wait(2 * time.Second)
		n.outbox.Reply(context.Background(), m.Reply, n.statusAnswer(st, err, page))
	}()
}

// takeStatusSlot holds one of the node's status gathers and one of rec's
// share of them until release: P.E.status and /debug/engines alike (an
// admin port any client can reach must not run unbounded gathers either).
func (n *Node) takeStatusSlot(rec *engineRec) (release func(), err error) {
	if rec.statusGathers.Add(1) > maxStatusGathersPerEngine {
		rec.statusGathers.Add(-1)
		return nil, fmt.Errorf("%w: %d status requests of this engine in flight, try again", ErrLimit,
			maxStatusGathersPerEngine)
	}
	select {
	case n.statusSlots <- struct{}{}:
	default:
		rec.statusGathers.Add(-1)
		return nil, fmt.Errorf("%w: %d status requests in flight, try again", ErrLimit, maxStatusGathers)
	}
	return func() { <-n.statusSlots; rec.statusGathers.Add(-1) }, nil
}

// slowConsumers routes a subscription's slow-consumer error (NATS dropped
// messages of it) to what must make up for them. Handlers are added as
// subscriptions are made, on the start's goroutine; the connection's error
// handler, on NATS's, may run before or while they are: so it reads them
// here, under a lock, and never the node's fields directly.
type slowConsumers struct {
	mu sync.Mutex
	on []func(*nats.Subscription) bool
}

// add registers f, which reports whether the subscription was its own.
func (sc *slowConsumers) add(f func(*nats.Subscription) bool) {
	sc.mu.Lock()
	sc.on = append(sc.on, f)
	sc.mu.Unlock()
}

// dropped tells the handler of sub that NATS dropped messages of it.
func (sc *slowConsumers) dropped(sub *nats.Subscription) {
	if sub == nil {
		return
	}
	sc.mu.Lock()
	on := sc.on
	sc.mu.Unlock()
	for _, f := range on {
		if f(sub) {
			return
		}
	}
}

// natsMsgCost is what a message pending in nats.go costs besides its body,
// headers, subject and reply (its Msg, queue links), rounded up; with the
// server's longest control line, which bounds the subject and reply, it
// sets the message count of the NATS client's half of the intake budget.
const natsMsgCost = 512

// natsPendingMsgs is the message count bound of a pending budget of
// budget bytes, for a server whose control lines are at most controlLine.
func natsPendingMsgs(budget int64, controlLine int) int {
	return int(max(1, budget/int64(natsMsgCost+controlLine)))
}

// controlLine is the longest protocol line a message reaching the node may
// have come with: a standalone embedded server's own limit; else at least
// nats-server's default (another server, or the embedded one's routes to
// servers that may allow their clients that much).
func (n *Node) controlLine() int {
	o := n.embeddedOpts
	if o == nil {
		return defaultMaxControlLine
	}
	if o.MaxControlLine > 0 && len(o.Routes) == 0 && o.Cluster.Port == 0 {
		return int(o.MaxControlLine)
	}
	return max(defaultMaxControlLine, int(o.MaxControlLine))
}
