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
// stuck, or a NATS whose permissions drop the reply).
const identityProbeTimeout = 2 * time.Second

// identityProbes is how many times a silent subscriber is asked.
const identityProbes = 3

// identity is what a node knows of other processes using its node id: the
// start's probe refuses to start beside one, and the node keeps listening
// to its id's hello and heartbeat for one that started beside it anyway
// (both probed before either answered) or came back from a partition.
type identity struct {
	mu   sync.Mutex
	boot string    // the other boot last heard ("" none)
	at   time.Time // when
	// logged is when a conflict was last logged: once a lease per boot.
	logged     time.Time
	loggedBoot string
}

// probeIdentity asks P._node.<id>.identity whether a process answers for
// this node's id. No responders: none does. Any answer from another boot,
// or a subscriber that stays silent for identityProbeTimeout, refuses the
// start with ErrNodeIDInUse. It runs before the node subscribes to anything
// (its own answer would be no proof), so two processes starting at the same
// moment can both pass it: watchIdentity then reports them.
func (n *Node) probeIdentity() error {
	if n.cfg.SkipNodeIDCheck {
		return nil
	}
	subj := messages.NodeSubject(n.cfg.Prefix, n.cfg.NodeID, messages.NodeVerbIdentity)
	timeout := min(identityProbeTimeout, n.cfg.Lease/2)
	var m *nats.Msg
	var err error
	// A process killed a moment ago may still have its subscription known
	// to another server of a NATS cluster (the route's unsubscribe is on
	// its way): a silent subscriber is asked again before it counts.
	for range identityProbes {
		if m, err = n.nc.Request(subj, nil, timeout); !errors.Is(err, nats.ErrTimeout) {
			break
		}
	}
	switch {
	case errors.Is(err, nats.ErrNoResponders):
		return nil
	case errors.Is(err, nats.ErrTimeout):
		return fmt.Errorf("%w: %q: a subscriber on %s did not answer %d probes of %s (a stuck process holding the id, or permissions that drop the answer; --skip-node-id-check skips the probe)",
			ErrNodeIDInUse, n.cfg.NodeID, subj, identityProbes, timeout)
	case err != nil:
		return fmt.Errorf("node id probe on %s: %w", subj, err)
	}
	var h messages.Hello
	if err := json.Unmarshal(m.Data, &h); err != nil || h.Boot == "" {
		return fmt.Errorf("%w: %q: %s answered, but not as a node (%q)", ErrNodeIDInUse, n.cfg.NodeID, subj, m.Data)
	}
	return fmt.Errorf("%w: %q is served by boot %s; stop it first, or give this process another --node-id",
		ErrNodeIDInUse, n.cfg.NodeID, h.Boot)
}

// watchIdentity answers the identity probe of a process starting with this
// node's id, and listens to the id's hello and heartbeat: NoEcho keeps the
// node's own from it, so any one heard is another process's (its boot is
// checked all the same). Each one heard is counted
// (kvactors_node_id_conflicts_total), logged once a lease per boot, and
// fails /readyz for a lease after it.
func (n *Node) watchIdentity() error {
	answer := func(m *nats.Msg) {
		data, _ := json.Marshal(messages.Hello{Node: n.cfg.NodeID, Boot: n.boot, LeaseMS: n.cfg.Lease.Milliseconds()})
		_ = m.Respond(data) // a prober that went away is not ours to report
	}
	heard := func(m *nats.Msg) {
		var h messages.Hello // hello and heartbeat share node and boot
		if json.Unmarshal(m.Data, &h) != nil || h.Boot == "" || h.Boot == n.boot {
			return
		}
		n.sameID(h.Boot)
	}
	for verb, h := range map[string]nats.MsgHandler{messages.NodeVerbIdentity: answer,
		messages.NodeVerbHello: heard, messages.NodeVerbHeartbeat: heard} {
		subj := messages.NodeSubject(n.cfg.Prefix, n.cfg.NodeID, verb)
		s, err := n.nc.Subscribe(subj, h)
		if err != nil {
			return fmt.Errorf("subscribe %s: %w", subj, err)
		}
		n.subs = append(n.subs, s)
	}
	return nil
}

// sameID records another process heard using this node's id.
func (n *Node) sameID(boot string) {
	n.metrics.IDConflicts.Inc()
	now := n.now()
	id := &n.identity
	id.mu.Lock()
	id.boot, id.at = boot, now
	log := boot != id.loggedBoot || now.Sub(id.logged) >= n.cfg.Lease
	if log {
		id.logged, id.loggedBoot = now, boot
	}
	id.mu.Unlock()
	if log {
		n.log.Error("another kvactors process is using this node id: engines may take it for a restart and free blocks under copies; stop one of them (PROTOCOL.md, Node identity)",
			"boot", n.boot, "other_boot", boot)
	}
}

// identityConflict is /readyz's account of another process heard using
// this node's id within the last lease (nil: none).
func (n *Node) identityConflict() error {
	id := &n.identity
	id.mu.Lock()
	defer id.mu.Unlock()
	if id.boot == "" || n.now().Sub(id.at) >= n.cfg.Lease {
		return nil
	}
	return fmt.Errorf("node id %q also in use by boot %s (heard %s ago)", n.cfg.NodeID, id.boot,
		n.now().Sub(id.at).Round(time.Millisecond))
}
