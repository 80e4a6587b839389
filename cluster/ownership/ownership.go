package ownership

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// Identity is one node process: its node id and the boot id of this start.
type Identity struct {
	Node string `json:"node"`
	Boot string `json:"boot"`
}

func (id Identity) String() string { return id.Node + "/" + id.Boot }

// Record is the value stored under an engine id in the ownership bucket.
// Renewed is the owner's own clock when it last wrote the record; it is
// shown to operators (`kvactors nodes`) and never compared with another
// host's clock: lapse is the bucket's max age, measured by the servers.
type Record struct {
	Identity
	LeaseMS int64 `json:"lease_ms"`
	Renewed int64 `json:"renewed_unix_ms"`
	// Closed marks the record a node leaves as it shuts down gracefully
	// (cluster.Owners.Leave): its engines are retired and it serves
	// nothing, so every other node takes the engine for unowned, while its
	// own next boot finds it as its previous boot's and tells the engine of
	// the restart at once. It lapses a lease after it was written.
	Closed bool `json:"closed,omitempty"`
}

// Entry is what a node read of an engine's ownership: the record and its
// revision, the fencing token. A missing key, a delete marker and a key the
// bucket expired are all "no entry" (nil).
type Entry struct {
	Record
	Revision uint64
}

// Errors of DecodeRecord.
var (
	ErrBadRecord = errors.New("ownership: bad record")
)

// EncodeRecord is the bucket value of r.
func EncodeRecord(r Record) []byte {
	b, _ := json.Marshal(r) // plain strings and ints: cannot fail
	return b
}

// DecodeRecord parses a bucket value; a record without node or boot is
// refused, so a stray write can never name an empty owner.
func DecodeRecord(b []byte) (Record, error) {
	var r Record
	if err := json.Unmarshal(b, &r); err != nil {
		return Record{}, fmt.Errorf("%w: %w", ErrBadRecord, err)
	}
	if r.Node == "" || r.Boot == "" {
		return Record{}, fmt.Errorf("%w: node %q boot %q", ErrBadRecord, r.Node, r.Boot)
	}
	return r, nil
}

// Action is what a node does with an engine's message.
type Action uint8

// Actions of Decide.
const (
	// Ignore: another node answers (or nobody should); stay silent and count.
	Ignore Action = iota
	// Serve: this node owns the engine and its lease is current.
	Serve
	// Claim: write the ownership record with compare-and-set: create when
	// Decision.Revision is 0, else replace that revision. Only the winner
	// serves; a loser ignores.
	Claim
	// Refuse: this node owns the engine and the register names another
	// node; answer with an error naming this node (not an engine reset).
	Refuse
)

var actionNames = [...]string{"ignore", "serve", "claim", "refuse"}

// String is the action's metric label.
func (a Action) String() string {
	if int(a) < len(actionNames) {
		return actionNames[a]
	}
	return fmt.Sprintf("Action(%d)", a)
}

// Input is everything Decide looks at. The caller reads the bucket and the
// clock; Decide does neither.
type Input struct {
	// Entry is the engine's current ownership, nil if none.
	Entry *Entry
	// Me is this node process.
	Me Identity
	// StandbyFor is the node this node stands by for ("" if none): it may
	// take over an engine of that node once the node's lease has lapsed.
	StandbyFor string
	// Register is true for P.E.register, false for every other verb.
	Register bool
	// SpecNode is the register's EngineSpec.node ("" if it names none).
	SpecNode string
	// Local is true when this node can reach the engine's memory (its shm
	// segments exist on this host, its CUDA device is here). A node never
	// claims an engine it cannot copy for.
	Local bool
	// NamedLive is true when SpecNode's node has sent a heartbeat within
	// the lease (a standby leaves a live named node to claim for itself).
	NamedLive bool
	// StandbyForLive is the same of StandbyFor's node: a standby also
	// leaves an engine that names no node to its live primary (it holds no
	// engine while its primary is alive: docs/CLUSTER.md "Deployment").
	StandbyForLive bool
	// Renewed is when this node last sent a write of Entry that succeeded
	// (claim or keep-alive), by this node's clock; zero if never.
	Renewed time.Time
	// Lease is the ownership lease (the bucket's max age).
	Lease time.Duration
	// Skew is how far the servers' clocks may differ (cluster.Config's
	// ClockSkew): this node serves for Lease less Skew.
	Skew time.Duration
	// Now is this node's clock.
	Now time.Time
}

// Decision is Decide's answer.
type Decision struct {
	Action Action
	// Owner is the owner the decision is about: the live owner when
	// ignoring or refusing, this node when serving or claiming.
	Owner string
	// Revision is the revision a Claim replaces (0: create).
	Revision uint64
	// Reason says why, for logs and the ignored-messages counter.
	Reason string
}

// Decide says what this node does with a message of one engine (shared
// PROTOCOL.md, Clusters: "Only the owner answers or applies an engine's
// messages, register included; every other node stays silent").
func Decide(in Input) Decision {
	e := in.Entry
	switch {
	case e == nil:
		return decideUnowned(in)
	case e.Node == in.Me.Node && e.Boot == in.Me.Boot:
		return decideMine(in)
	case e.Node == in.Me.Node:
		// A record of this node's previous process: it is dead (a node id
		// runs once), so take the engine back at once rather than wait out
		// the lease; compare-and-set on its revision fences any stale writer.
		if in.Register && in.Local && specAllows(in) {
			return Decision{Action: Claim, Owner: in.Me.Node, Revision: e.Revision, Reason: "previous boot " + e.Boot}
		}
		return Decision{Action: Ignore, Owner: e.Node, Reason: "owned by a previous boot"}
	case e.Closed:
		// Left by a node that shut down: nobody owns the engine; a claim
		// replaces the marker by compare-and-set on its revision.
		d := decideUnowned(in)
		if d.Action == Claim {
			d.Revision = e.Revision
		}
		return d
	default:
		return Decision{Action: Ignore, Owner: e.Node, Reason: "owned by " + e.Node}
	}
}

func decideUnowned(in Input) Decision {
	if !in.Register {
		// Only a register claims: events of an engine nobody owns wait for
		// the engine to register again (it sees the owner's node is lost).
		return Decision{Action: Ignore, Reason: "no owner"}
	}
	if !in.Local {
		return Decision{Action: Ignore, Reason: "engine memory not on this host"}
	}
	switch {
	case in.SpecNode == "" && in.StandbyFor != "" && in.StandbyForLive:
		return Decision{Action: Ignore, Reason: "standby: " + in.StandbyFor + " is live"}
	case in.SpecNode == "" || in.SpecNode == in.Me.Node:
		return Decision{Action: Claim, Owner: in.Me.Node, Reason: "unowned"}
	case in.SpecNode == in.StandbyFor && !in.NamedLive:
		return Decision{Action: Claim, Owner: in.Me.Node, Reason: "standby for " + in.StandbyFor}
	case in.SpecNode == in.StandbyFor:
		return Decision{Action: Ignore, Reason: "named node " + in.SpecNode + " is live"}
	default:
		return Decision{Action: Ignore, Reason: "names node " + in.SpecNode}
	}
}

func decideMine(in Input) Decision {
	// The server expires the record a lease after the write it stamped; the
	// node measures from when it sent that write, which is earlier by one
	// trip only, and stops Skew sooner still: a server whose clock runs
	// ahead (a new leader's, a step, a slew) expires the record that much
	// early, and the node stops serving before anyone else can claim.
	if in.Renewed.IsZero() || in.Now.Sub(in.Renewed) >= in.Lease-in.Skew {
		if in.Register && in.Local && specAllows(in) {
			// Renew through compare-and-set: it fails if another node took
			// the engine meanwhile.
			return Decision{Action: Claim, Owner: in.Me.Node, Revision: in.Entry.Revision, Reason: "own lease lapsed"}
		}
		return Decision{Action: Ignore, Owner: in.Me.Node, Reason: "own lease lapsed"}
	}
	if in.Register && !specAllows(in) {
		return Decision{Action: Refuse, Owner: in.Me.Node, Reason: "names node " + in.SpecNode}
	}
	return Decision{Action: Serve, Owner: in.Me.Node}
}

// specAllows: a register may name this node, no node, or the node this one
// stands by for (after a takeover the engine still names its first node).
func specAllows(in Input) bool {
	return in.SpecNode == "" || in.SpecNode == in.Me.Node || (in.StandbyFor != "" && in.SpecNode == in.StandbyFor)
}

// RefusalError is the register error the owner answers when a register
// names another node.
func RefusalError(owner, named string) string {
	return fmt.Sprintf("engine is owned by node %s (register names node %s)", owner, named)
}
