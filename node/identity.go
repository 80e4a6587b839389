package node

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/messages"
)

// ErrNodeIDInUse means another running kvactors process answered for this
// node's id at start: two processes must never share a node id (PROTOCOL.md
// "Node identity"), since an engine takes a newer boot of its node as proof
// that the old process is gone and may then free blocks the old one is
// still copying.
var ErrNodeIDInUse = errors.New("node id in use by another kvactors process")

// identityProbeTimeout bounds the start's identity probe when a subscriber
// exists but does not answer (a process that holds the subscription and is
// stuck, or one whose host is gone while NATS still holds its connection).
const identityProbeTimeout = 2 * time.Second

// identityProbes is how many times a silent subscriber is asked.
const identityProbes = 3

// identity is what a node knows of other processes using its node id: the
// start's probe refuses to start beside one, and the node keeps listening
// to its id's hello and heartbeat for one that started beside it anyway
// (--skip-node-id-check) or came back from a partition.
type identity struct {
	mu sync.Mutex
	// held: the start's probe passed. Until then the node answers a probe
	// as starting, and yields to a starting prober with a lower boot.
	held    bool
	yieldTo string               // the lower boot that probed while this one started ("" none)
	boot    string               // the other boot last heard ("" none)
	at      time.Time            // when
	until   time.Time            // when /readyz stops failing for it
	logged  map[string]time.Time // per other boot: when its conflict was last logged
	heard   chan struct{}        // a signal per other boot heard (the silent probe's wait)
}

// probeIdentity asks P._node.<id>.identity whether a process answers for
// this node's id. It runs after watchIdentity subscribed the node's own
// answer (NoEcho keeps the node from asking itself), so of two processes
// starting seconds apart the later finds the earlier. No responders: the
// id is free. An answer from a boot that holds the id, or from one starting
// at the same moment with a lower boot, refuses the start with
// ErrNodeIDInUse; a starting one with a higher boot yields to this one. A
// subscriber that stays silent is told apart by its heartbeats: a process
// that holds the id and is stuck still beats; one whose host is gone (its
// connection kept by NATS until the server's pings time out, minutes) does
// not, and after a lease without one the node starts, with a warning.
func (n *Node) probeIdentity() error {
	if n.cfg.SkipNodeIDCheck {
		return n.holdIdentity()
	}
	subj := messages.NodeSubject(n.cfg.Prefix, n.cfg.NodeID, messages.NodeVerbIdentity)
	timeout := min(identityProbeTimeout, n.cfg.Lease/2)
	var answers []*nats.Msg
	var err error
	// A process killed a moment ago may still have its subscription known
	// to another server of a NATS cluster (the route's unsubscribe is on
	// its way): a silent subscriber is asked again before it counts.
	for range identityProbes {
		if answers, err = n.askIdentity(subj, timeout); !errors.Is(err, nats.ErrTimeout) {
			break
		}
	}
	switch {
	case errors.Is(err, nats.ErrNoResponders):
	case errors.Is(err, nats.ErrTimeout):
		if err := n.awaitSilentHolder(subj, timeout); err != nil {
			return err
		}
	case err != nil:
		return fmt.Errorf("node id probe on %s: %w", subj, err)
	default:
		if err := n.judgeAnswers(subj, answers); err != nil {
			return err
		}
	}
	return n.holdIdentity()
}

// askIdentity sends one probe (this node's hello body, so a starting
// process can tell whether to yield) and gathers the answers: the first
// within timeout, then any that follow within timeout/8 (a running node
// and one starting beside it may both answer).
func (n *Node) askIdentity(subj string, timeout time.Duration) ([]*nats.Msg, error) {
	inbox := n.nc.NewRespInbox()
	sub, err := n.nc.SubscribeSync(inbox)
	if err != nil {
		return nil, err
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := n.nc.PublishRequest(subj, inbox, n.helloBody(false)); err != nil {
		return nil, err
	}
	first, err := sub.NextMsg(timeout)
	if err != nil {
		return nil, err // nats.ErrNoResponders: nobody subscribes
	}
	answers := []*nats.Msg{first}
	for {
		m, err := sub.NextMsg(timeout / 8)
		if err != nil {
			return answers, nil
		}
		answers = append(answers, m)
	}
}

// judgeAnswers refuses the start for any answer but a starting process's
// with a higher boot (that one yields: it heard this probe).
func (n *Node) judgeAnswers(subj string, answers []*nats.Msg) error {
	for _, m := range answers {
		var h messages.Hello
		switch {
		case json.Unmarshal(m.Data, &h) != nil || h.Boot == "":
			return fmt.Errorf("%w: %q: %s answered, but not as a node (%q)", ErrNodeIDInUse, n.cfg.NodeID, subj, m.Data)
		case !h.Starting:
			return fmt.Errorf("%w: %q is served by boot %s; stop it first, or give this process another --node-id",
				ErrNodeIDInUse, n.cfg.NodeID, h.Boot)
		case h.Boot < n.boot:
			return fmt.Errorf("%w: %q: boot %s is starting with it at the same moment and goes first (the lower boot does)",
				ErrNodeIDInUse, n.cfg.NodeID, h.Boot)
		}
	}
	return nil
}

// awaitSilentHolder waits a lease for a heartbeat or hello of another boot
// after the probes went unanswered (heartbeats go every lease/4: a process
// whose lease is up to 4× this one's beats within it).
func (n *Node) awaitSilentHolder(subj string, timeout time.Duration) error {
	t := time.NewTimer(n.cfg.Lease)
	defer t.Stop()
	select {
	case <-n.identity.heard:
		n.identity.mu.Lock()
		other := n.identity.boot
		n.identity.mu.Unlock()
		return fmt.Errorf("%w: %q: boot %s beats with it, but a subscriber on %s did not answer %d probes of %s (a stuck process, or permissions that drop the answer; --skip-node-id-check skips the probe)",
			ErrNodeIDInUse, n.cfg.NodeID, other, subj, identityProbes, timeout)
	case <-t.C:
	}
	n.log.Warn("a subscriber on this node id's identity subject did not answer, and no other boot's heartbeat came for a lease: taking it for a process that is gone (its host lost, its connection not yet timed out by NATS); starting",
		"subject", subj, "probes", identityProbes, "probe_timeout", timeout, "lease", n.cfg.Lease)
	return nil
}

// holdIdentity ends the start's probe: from here on the node answers as
// the id's holder, unless a starting process with a lower boot probed it
// first (then both saw each other, and that one goes on).
func (n *Node) holdIdentity() error {
	id := &n.identity
	id.mu.Lock()
	defer id.mu.Unlock()
	if id.yieldTo != "" {
		return fmt.Errorf("%w: %q: boot %s started with it at the same moment and goes first (the lower boot does)",
			ErrNodeIDInUse, n.cfg.NodeID, id.yieldTo)
	}
	id.held = true
	return nil
}

// helloBody is this node's hello, as an identity probe or answer carries it.
func (n *Node) helloBody(starting bool) []byte {
	data, _ := json.Marshal(messages.Hello{Node: n.cfg.NodeID, Boot: n.boot, LeaseMS: n.cfg.Lease.Milliseconds(),
		Starting: starting})
	return data
}

// watchIdentity answers the identity probe of a process starting with this
// node's id, and listens to the id's hello and heartbeat: NoEcho keeps the
// node's own from it, so any one heard is another process's (its boot is
// checked all the same). Each one heard is counted
// (kvactors_node_id_conflicts_total), logged once a lease per boot, and
// fails /readyz for the longer of the two leases after it. Its
// subscriptions are not drained by Close: a node shutting down still
// copies and beats, and holds its id until its connection closes.
func (n *Node) watchIdentity() error {
	n.identity.heard = make(chan struct{}, 1)
	answer := func(m *nats.Msg) {
		var asker messages.Hello // an empty probe asks without a boot: never yielded to
		_ = json.Unmarshal(m.Data, &asker)
		id := &n.identity
		id.mu.Lock()
		starting := !id.held
		if starting && asker.Boot != "" && asker.Boot < n.boot && id.yieldTo == "" {
			id.yieldTo = asker.Boot
		}
		id.mu.Unlock()
		_ = m.Respond(n.helloBody(starting)) // a prober that went away is not ours to report
	}
	heard := func(m *nats.Msg) {
		var h messages.Hello // hello and heartbeat share node, boot and lease_ms
		if json.Unmarshal(m.Data, &h) != nil || h.Boot == "" || h.Boot == n.boot {
			return
		}
		n.sameID(h.Boot, time.Duration(h.LeaseMS)*time.Millisecond)
	}
	for verb, h := range map[string]nats.MsgHandler{messages.NodeVerbIdentity: answer,
		messages.NodeVerbHello: heard, messages.NodeVerbHeartbeat: heard} {
		subj := messages.NodeSubject(n.cfg.Prefix, n.cfg.NodeID, verb)
		s, err := n.nc.Subscribe(subj, h)
		if err != nil {
			return fmt.Errorf("subscribe %s: %w", subj, err)
		}
		n.idSubs = append(n.idSubs, s)
	}
	// The probe that follows must find the answer in place on every server.
	if err := n.nc.Flush(); err != nil {
		return fmt.Errorf("subscribe %s: %w", messages.NodeSubject(n.cfg.Prefix, n.cfg.NodeID, "*"), err)
	}
	return nil
}

// sameID records another process heard using this node's id, beating with
// the given lease (0: unknown, this node's own is taken).
func (n *Node) sameID(boot string, lease time.Duration) {
	n.metrics.IDConflicts.Inc()
	now := n.now()
	id := &n.identity
	id.mu.Lock()
	id.boot, id.at, id.until = boot, now, now.Add(max(n.cfg.Lease, lease))
	if id.logged == nil {
		id.logged = map[string]time.Time{}
	}
	last, seen := id.logged[boot]
	log := !seen || now.Sub(last) >= n.cfg.Lease
	if log {
		for b, at := range id.logged { // bounded by the boots heard within a lease
			if now.Sub(at) >= n.cfg.Lease {
				delete(id.logged, b)
			}
		}
		id.logged[boot] = now
	}
	id.mu.Unlock()
	select {
	case id.heard <- struct{}{}:
	default:
	}
	if log {
		n.log.Error("another kvactors process is using this node id: engines may take it for a restart and free blocks under copies; stop one of them (PROTOCOL.md, Node identity)",
			"boot", n.boot, "other_boot", boot)
	}
}

// identityConflict is /readyz's account of another process heard using
// this node's id within the last lease (the longer of the two; nil: none).
func (n *Node) identityConflict() error {
	id := &n.identity
	id.mu.Lock()
	defer id.mu.Unlock()
	now := n.now()
	if id.boot == "" || !now.Before(id.until) {
		return nil
	}
	return fmt.Errorf("node id %q also in use by boot %s (heard %s ago)", n.cfg.NodeID, id.boot,
		now.Sub(id.at).Round(time.Millisecond))
}
