package client_test

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/internal/testkit"
	"github.com/kvactors/kvactors/messages"
)

// fakeNode speaks the node side of protocol v2 sessions and delivery just
// far enough to exercise the SDK: register, heartbeat and unregister
// replies, hello and node heartbeats, gap detection with resync, and one
// release per finished or preempted event (no copies).
type fakeNode struct {
	t      testing.TB
	nc     *nats.Conn
	prefix string
	node   string
	boot   string
	lease  time.Duration

	mu          sync.Mutex
	registered  bool
	refuse      string
	epoch       string
	applied     uint64
	gapped      bool
	released    uint64          // in epoch
	reqs        map[string]bool // request -> preempted
	log         []fakeEvent     // every applied event
	resyncs     int
	unregisters int
	holdRelease func(rseq uint64) bool // true: count the release but do not publish it
	muteResync  bool                   // resyncs are counted but never reach the engine
	hbDelay     time.Duration          // each heartbeat reply waits this long (a busy node)
	loadGate    chan struct{}          // non-nil: each load replies once a value comes (or the node dies)
	loadsHeld   chan struct{}          // non-nil: told when a load waits at the gate
	dropLoads   bool                   // loads complete but their replies are lost
	loadBoot    string                 // non-empty: the boot a load's reply names (read once the gate opens)
	lastBeat    time.Time              // just before the last node heartbeat was published
	mute        bool                   // no hello and no node heartbeats: engines learn its boot from replies
	beatsPaused bool                   // no node heartbeats until unpaused (pauseBeats)

	subs      []*nats.Subscription
	stop      chan struct{} // closed by kill: held loads give up
	stopBeats func()
}

type fakeEvent struct {
	epoch string
	ev    messages.Event
}

// startFakeNode starts a node; each setup runs before it subscribes or says
// hello.
func startFakeNode(t testing.TB, nc *nats.Conn, node, boot string, lease time.Duration,
	setup ...func(*fakeNode)) *fakeNode {
	t.Helper()
	f := &fakeNode{t: t, nc: nc, prefix: "kvactors", node: node, boot: boot, lease: lease, reqs: map[string]bool{},
		stop: make(chan struct{})}
	for _, s := range setup {
		s(f)
	}
	for subject, h := range map[string]nats.MsgHandler{
		"kvactors.*.register":   f.onRegister,
		"kvactors.*.events":     f.onEvents,
		"kvactors.*.heartbeat":  f.onHeartbeat,
		"kvactors.*.unregister": f.onUnregister,
		"kvactors.*.load":       f.onLoad,
	} {
		s, err := nc.Subscribe(subject, h)
		if err != nil {
			t.Fatalf("fake node: subscribe %s: %v", subject, err)
		}
		f.subs = append(f.subs, s)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if !f.mute {
		f.publish(messages.NodeSubject(f.prefix, node, messages.NodeVerbHello),
			messages.Hello{Node: node, Boot: boot, LeaseMS: lease.Milliseconds()})
	}
	f.stopBeats = testkit.Every(t, lease/4, f.beat)
	t.Cleanup(f.kill)
	return f
}

// kill stops the node at once, like kill -9: no reply, no heartbeat.
func (f *fakeNode) kill() {
	select {
	case <-f.stop:
		return
	default:
	}
	close(f.stop)
	f.stopBeats()
	for _, s := range f.subs {
		_ = s.Unsubscribe()
	}
}

// beat publishes one node heartbeat, every lease/4 until kill.
func (f *fakeNode) beat() {
	if f.mute {
		return
	}
	// Published under f.mu, so none is published once pauseBeats returns.
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.beatsPaused {
		f.lastBeat = time.Now() // before the publish: no client can see it sooner
		f.publish(messages.NodeSubject(f.prefix, f.node, messages.NodeVerbHeartbeat),
			messages.NodeHeartbeat{Node: f.node, Boot: f.boot})
	}
}

func (f *fakeNode) publish(subject string, body any) {
	data, _ := json.Marshal(body)
	_ = f.nc.Publish(subject, data)
}

func (f *fakeNode) reply(m *nats.Msg, body any) {
	data, _ := json.Marshal(body)
	_ = m.Respond(data)
}

func engineOf(subject string) string {
	_, rest, _ := strings.Cut(subject, ".")
	e, _, _ := strings.Cut(rest, ".")
	return e
}

func (f *fakeNode) onRegister(m *nats.Msg) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.refuse != "" {
		f.reply(m, messages.RegisterReply{Error: f.refuse, Node: f.node, Boot: f.boot})
		return
	}
	f.registered = true
	f.reply(m, messages.RegisterReply{OK: true, Node: f.node, Boot: f.boot, LeaseMS: f.lease.Milliseconds()})
}

func (f *fakeNode) onUnregister(m *nats.Msg) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.registered {
		f.reply(m, messages.UnregisterReply{Node: f.node, Boot: f.boot, Error: "unknown engine " + engineOf(m.Subject)})
		return
	}
	f.unregisters++
	n := 0
	for id := range f.reqs {
		f.releaseLocked(engineOf(m.Subject), id, messages.ReasonEngineGone)
		n++
	}
	f.reqs = map[string]bool{}
	f.registered = false
	f.reply(m, messages.UnregisterReply{OK: true, Released: n, Node: f.node, Boot: f.boot})
}

// forget drops engine as an expiry does: each live request is released
// engine_gone (its copies ended; this node has none), except those held
// (copies still running: the test releases them later with releaseGone),
// and the engine is unknown from then on.
func (f *fakeNode) forget(engine string, held ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for id := range f.reqs {
		if !slices.Contains(held, id) {
			f.releaseLocked(engine, id, messages.ReasonEngineGone)
		}
	}
	f.reqs, f.registered = map[string]bool{}, false
}

// releaseGone publishes the engine_gone of a request forget held.
func (f *fakeNode) releaseGone(engine, req string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.releaseLocked(engine, req, messages.ReasonEngineGone)
}

func (f *fakeNode) onHeartbeat(m *nats.Msg) {
	var hb messages.HeartbeatRequest
	_ = json.Unmarshal(m.Data, &hb)
	f.mu.Lock()
	delay := f.hbDelay
	f.mu.Unlock()
	time.Sleep(delay) // the fault: a slow reply, not synchronisation
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.registered {
		f.reply(m, messages.HeartbeatReply{Node: f.node, Boot: f.boot, Error: "unknown engine " + engineOf(m.Subject)})
		return
	}
	if hb.Epoch == f.epoch && hb.Seq > f.applied {
		f.gapLocked(engineOf(m.Subject), f.applied+1, hb.Seq)
	}
	rep := messages.HeartbeatReply{Node: f.node, Boot: f.boot, Epoch: hb.Epoch}
	if hb.Epoch == f.epoch {
		rep.Applied, rep.Released = f.applied, f.released
	}
	f.reply(m, rep)
}

// onLoad answers a load (no copy) at once, after the gate opens, or never
// (dropLoads: done, but the reply is lost).
func (f *fakeNode) onLoad(m *nats.Msg) {
	var req messages.LoadRequest
	_ = json.Unmarshal(m.Data, &req)
	f.mu.Lock()
	gate, held, drop := f.loadGate, f.loadsHeld, f.dropLoads
	f.mu.Unlock()
	if gate != nil {
		if held != nil {
			held <- struct{}{}
		}
		select {
		case <-gate:
		case <-f.stop:
			return
		}
	}
	if drop {
		return
	}
	boot := f.boot
	f.mu.Lock()
	if f.loadBoot != "" {
		boot = f.loadBoot
	}
	f.mu.Unlock()
	f.reply(m, messages.LoadReply{OK: true, LoadedTokens: req.NumTokens, Node: f.node, Boot: boot})
}

// gateLoads makes each load wait at the node until a value comes on gate
// (or the node dies); held is told when one waits.
func (f *fakeNode) gateLoads() (gate, held chan struct{}) {
	gate, held = make(chan struct{}, 1), make(chan struct{}, 4)
	f.mu.Lock()
	f.loadGate, f.loadsHeld = gate, held
	f.mu.Unlock()
	return gate, held
}

// refuseRegisters makes the node refuse every register with why ("": answer
// them again), as a node at --max-engines or overloaded does.
func (f *fakeNode) refuseRegisters(why string) {
	f.mu.Lock()
	f.refuse = why
	f.mu.Unlock()
}

// pauseBeats stops (true) or restarts the node heartbeats; no heartbeat
// is published once it returns until it is called with false.
func (f *fakeNode) pauseBeats(paused bool) {
	f.mu.Lock()
	f.beatsPaused = paused
	f.mu.Unlock()
}

// lastHeartbeat is when the node last published a heartbeat (just before).
func (f *fakeNode) lastHeartbeat() time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.lastBeat
}

func (f *fakeNode) gapLocked(engine string, expected, got uint64) {
	f.gapped = true
	f.resyncs++
	if f.muteResync {
		return
	}
	f.publish(messages.EngineSubject(f.prefix, engine, messages.VerbResync), messages.Resync{Node: f.node,
		Boot: f.boot, Epoch: f.epoch, Expected: expected, Got: got, Reason: messages.ResyncGap})
}

func (f *fakeNode) onEvents(m *nats.Msg) {
	engine := engineOf(m.Subject)
	b, _, err := ingest.DecodeBatch(engine, m.Data, ingest.Limits{})
	if err != nil {
		f.t.Errorf("fake node: bad batch %q: %v", m.Data, err)
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.registered {
		return
	}
	if b.Epoch != f.epoch {
		for id := range f.reqs {
			f.releaseLocked(engine, id, messages.ReasonEngineReset)
		}
		f.epoch, f.applied, f.gapped, f.released, f.reqs = b.Epoch, 0, false, 0, map[string]bool{}
	}
	switch {
	case f.gapped || b.Seq <= f.applied:
		return
	case b.Seq != f.applied+1:
		f.gapLocked(engine, f.applied+1, b.Seq)
		return
	}
	f.applied = b.Seq
	for _, ev := range b.Events {
		f.log = append(f.log, fakeEvent{epoch: b.Epoch, ev: ev})
		switch ev.Type {
		case messages.EvAdded:
			if _, ok := f.reqs[ev.Request]; !ok {
				f.reqs[ev.Request] = false
			}
		case messages.EvPreempted:
			if pre, ok := f.reqs[ev.Request]; ok && !pre {
				f.reqs[ev.Request] = true
				f.releaseLocked(engine, ev.Request, messages.ReasonPreempted)
			}
		case messages.EvResumed:
			if _, ok := f.reqs[ev.Request]; ok {
				f.reqs[ev.Request] = false
			}
		case messages.EvFinished:
			reason := messages.ReasonFinished
			if ev.Aborted {
				reason = messages.ReasonAborted
			}
			delete(f.reqs, ev.Request)
			f.releaseLocked(engine, ev.Request, reason)
		}
	}
}

func (f *fakeNode) releaseLocked(engine, req, reason string) {
	f.released++
	if f.holdRelease != nil && f.holdRelease(f.released) {
		return
	}
	f.publish(messages.EngineSubject(f.prefix, engine, messages.VerbReleased),
		messages.Released{Request: req, Epoch: f.epoch, RSeq: f.released, Reason: reason})
}

// awaitApplied waits (5 s) until the node has applied at least n events
// of epoch.
func (f *fakeNode) awaitApplied(t *testing.T, epoch string, n int) {
	t.Helper()
	testkit.Eventually(t, 5*time.Second, time.Millisecond, func() error {
		if evs := f.events(epoch); len(evs) < n {
			return fmt.Errorf("the node applied %d events of epoch %s, want %d", len(evs), epoch, n)
		}
		return nil
	})
}

// events returns the applied events of epoch.
func (f *fakeNode) events(epoch string) []messages.Event {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []messages.Event
	for _, e := range f.log {
		if e.epoch == epoch {
			out = append(out, e.ev)
		}
	}
	return out
}

// lapse resets the engine's current epoch as a node does after its own
// NATS lapse (or the engine's silence): every request it tracks is
// released engine_reset carrying the current epoch, running ones too, and
// the epoch's later batches are dropped. Its resync order waits for
// lapseEnds.
func (f *fakeNode) lapse(engine string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for id := range f.reqs {
		f.releaseLocked(engine, id, messages.ReasonEngineReset)
	}
	f.reqs, f.gapped = map[string]bool{}, true
}

// lapseEnds orders the resync a lapse owes (reason reconnect).
func (f *fakeNode) lapseEnds(engine string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.resyncs++
	f.publish(messages.EngineSubject(f.prefix, engine, messages.VerbResync), messages.Resync{Node: f.node,
		Boot: f.boot, Epoch: f.epoch, Expected: f.applied + 1, Reason: messages.ResyncReconnect})
}

// overflow drops the engine's epoch from now on, as a node whose intake
// was full does, and asks it to resync (reason overflow).
func (f *fakeNode) overflow(engine string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.gapped = true
	f.resyncs++
	f.publish(messages.EngineSubject(f.prefix, engine, messages.VerbResync), messages.Resync{Node: f.node,
		Boot: f.boot, Epoch: f.epoch, Expected: f.applied + 1, Reason: messages.ResyncOverflow})
}

func (f *fakeNode) counts() (resyncs, unregisters int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.resyncs, f.unregisters
}
