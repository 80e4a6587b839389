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
	// heard signals each hello or heartbeat of another boot heard while the
	// start's probe runs (not a conflict yet: the start decides), and
	// startHeard is the last such boot.
	heard      chan struct{}
	startHeard string
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
		id := &n.identity
		id.mu.Lock()
		starting := !id.held
		if starting {
			id.startHeard = h.Boot
		}
		id.mu.Unlock()
		if starting {
			select {
			case id.heard <- struct{}{}:
			default:
			}
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
	// The answer in place on this node's server before the probe; the
	// other servers of a NATS cluster learn of it later, over the routes,
	// which is why the probe asks twice (probeIdentity).
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
