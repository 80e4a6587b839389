package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/messages"
)

// identityProbeTimeout bounds one identity probe when a subscriber exists
// but does not answer (a process that holds the subscription and is stuck,
// or one whose host is gone while NATS still holds its connection).
const identityProbeTimeout = 2 * time.Second

// identityProbes is how many times a silent subscriber is asked.
const identityProbes = 3

// probeIdentity asks P._node.<id>.identity whether a process answers for
// this node's id (PROTOCOL.md "Node identity"). It runs after
// watchIdentity subscribed the node's own answer (NoEcho keeps the node
// from asking itself), so of two processes starting apart the later finds
// the earlier. It asks twice, a settle delay apart: on a NATS cluster the
// answer's interest reaches the other servers over the routes only after
// Flush, so two starting at the same moment on two servers may both find
// no responders at first.
//
// No responders, twice: the id is free. An answer from a boot that holds
// the id, or from one starting with a lower boot, refuses the start with
// ErrNodeIDInUse. Contention (a starting answerer with a higher boot, which
// yields to this one since it heard this probe, or a subscriber that stays
// silent) is settled by heartbeats: a holder beats whether or not it
// answers (stuck, or its answer lost), so one heard within a lease refuses
// the start; none lets it go on (a silent subscriber is then a process
// whose host is gone, its connection kept by NATS until the server's pings
// time out, minutes).
func (n *Node) probeIdentity(ctx context.Context) error {
	if n.cfg.SkipNodeIDCheck {
		return n.holdIdentity()
	}
	subj := messages.NodeSubject(n.cfg.Prefix, n.cfg.NodeID, messages.NodeVerbIdentity)
	timeout := min(identityProbeTimeout, n.cfg.Lease/2)
	contended, silent := false, false
	for round := range 2 {
		if round == 1 && !pause(ctx, identitySettle(timeout)) {
			return fmt.Errorf("node id probe on %s: %w", subj, ctx.Err())
		}
		answers, err := n.askIdentityRetrying(ctx, subj, timeout)
		switch {
		case errors.Is(err, nats.ErrNoResponders):
		case errors.Is(err, nats.ErrTimeout):
			contended, silent = true, true
		case err != nil:
			return fmt.Errorf("node id probe on %s: %w", subj, err)
		default:
			starting, err := n.judgeAnswers(subj, answers)
			if err != nil {
				return err
			}
			contended = contended || starting
		}
		if silent {
			break // asked identityProbes times already
		}
	}
	if contended {
		if err := n.awaitHolder(ctx, subj, timeout, silent); err != nil {
			return err
		}
	}
	return n.holdIdentity()
}

// identitySettle is how long a start waits, after its first probe, for
// its answer's interest to reach every server of a NATS cluster (routes on
// one network carry it in milliseconds).
func identitySettle(timeout time.Duration) time.Duration { return timeout / 8 }

// askIdentityRetrying asks up to identityProbes times while the asking
// times out: a process killed a moment ago may still have its subscription
// known to another server of a NATS cluster (the route's unsubscribe is on
// its way), so a silent subscriber is asked again before it counts.
func (n *Node) askIdentityRetrying(ctx context.Context, subj string, timeout time.Duration) ([]*nats.Msg, error) {
	var answers []*nats.Msg
	var err error
	for range identityProbes {
		if answers, err = n.askIdentity(ctx, subj, timeout); !errors.Is(err, nats.ErrTimeout) {
			break
		}
	}
	return answers, err
}

// askIdentity sends one probe (this node's hello body, so a starting
// process can tell whether to yield) and gathers the answers: the first
// within timeout, then any that follow within timeout/8 (a running node
// and one starting beside it may both answer).
func (n *Node) askIdentity(ctx context.Context, subj string, timeout time.Duration) ([]*nats.Msg, error) {
	inbox := n.nc.NewRespInbox()
	sub, err := n.nc.SubscribeSync(inbox)
	if err != nil {
		return nil, err
	}
	defer func() { _ = sub.Unsubscribe() }()
	if err := n.nc.PublishRequest(subj, inbox, n.helloBody(false)); err != nil {
		return nil, err
	}
	next := func(d time.Duration) (*nats.Msg, error) {
		c, cancel := context.WithTimeout(ctx, d)
		defer cancel()
		m, err := sub.NextMsgWithContext(c)
		if errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil {
			err = nats.ErrTimeout
		}
		return m, err
	}
	first, err := next(timeout)
	if err != nil {
		return nil, err // nats.ErrNoResponders: nobody subscribes
	}
	answers := []*nats.Msg{first}
	for {
		m, err := next(timeout / 8)
		if err != nil {
			return answers, ctx.Err()
		}
		answers = append(answers, m)
	}
}

// judgeAnswers refuses the start for any answer but a starting process's
// with a higher boot (that one yields: it heard this probe), and reports
// whether there was such an answer.
func (n *Node) judgeAnswers(subj string, answers []*nats.Msg) (starting bool, err error) {
	for _, m := range answers {
		var h messages.Hello
		switch {
		case json.Unmarshal(m.Data, &h) != nil || h.Boot == "":
			return false, fmt.Errorf("%w: %q: %s answered, but not as a node (%q)", ErrNodeIDInUse, n.cfg.NodeID, subj, m.Data)
		case !h.Starting:
			return false, fmt.Errorf("%w: %q is served by boot %s; stop it first, or give this process another --node-id",
				ErrNodeIDInUse, n.cfg.NodeID, h.Boot)
		case h.Boot < n.boot:
			return false, fmt.Errorf("%w: %q: boot %s is starting with it at the same moment and goes first (the lower boot does)",
				ErrNodeIDInUse, n.cfg.NodeID, h.Boot)
		}
		starting = true
	}
	return starting, nil
}

// awaitHolder listens a lease for a hello or heartbeat of another boot
// (heartbeats go every lease/4: a process whose lease is up to 4× this
// one's beats within it). Only what is heard from here on counts: a
// process that beat before and is gone now holds nothing.
func (n *Node) awaitHolder(ctx context.Context, subj string, timeout time.Duration, silent bool) error {
	id := &n.identity
	select {
	case <-id.heard:
	default:
	}
	t := time.NewTimer(n.cfg.Lease)
	defer t.Stop()
	select {
	case <-id.heard:
		id.mu.Lock()
		other := id.startHeard
		id.mu.Unlock()
		why := "answers as starting"
		if silent {
			why = fmt.Sprintf("did not answer %d probes of %s", identityProbes, timeout)
		}
		return fmt.Errorf("%w: %q is served by boot %s (heard beating), while a subscriber on %s %s (a stuck process, or permissions that drop the answer; --skip-node-id-check skips the probe)",
			ErrNodeIDInUse, n.cfg.NodeID, other, subj, why)
	case <-ctx.Done():
		return fmt.Errorf("node id probe on %s: %w", subj, ctx.Err())
	case <-t.C:
	}
	if silent {
		n.log.Warn("a subscriber on this node id's identity subject did not answer, and no other boot's heartbeat came for a lease: taking it for a process that is gone (its host lost, its connection not yet timed out by NATS); starting",
			"subject", subj, "probes", identityProbes, "probe_timeout", timeout, "lease", n.cfg.Lease)
	}
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
