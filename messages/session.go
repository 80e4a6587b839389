package messages

import (
	"fmt"
	"strconv"
	"strings"
)

// Protocol v2 vocabulary: sessions and delivery (shared/PROTOCOL.md
// "Sessions", "Delivery"). Engine subjects are P.<engine>.<verb>; node
// subjects are P._node.<node>.<verb>.

// Verbs of engine subjects, in both directions.
const (
	VerbRegister   = "register"   // engine → node, request/reply
	VerbEvents     = "events"     // engine → node
	VerbHeartbeat  = "heartbeat"  // engine → node, request/reply
	VerbUnregister = "unregister" // engine → node, request/reply
	VerbLookup     = "lookup"     // engine → node, request/reply
	VerbLoad       = "load"       // engine → node, request/reply
	VerbStatus     = "status"     // anyone → node, request/reply
	VerbReleased   = "released"   // node → engine
	VerbStored     = "stored"     // node → engine
	VerbKVEvents   = "kv_events"  // node → routers
	VerbResync     = "resync"     // node → engine
)

// Node subjects: P._node.<node>.<verb>.
const (
	NodeToken         = "_node"
	NodeVerbHello     = "hello"
	NodeVerbHeartbeat = "heartbeat"
	NodeVerbFetch     = "fetch"
	// NodeVerbKeys is the key-set catch-up (clusters): request/reply, one
	// page of the node's (namespace, key) pairs per reply.
	NodeVerbKeys = "keys"
	// NodeVerbIdentity is request/reply: a node answers its Hello, so a
	// process starting with the same node id finds it and refuses to start.
	NodeVerbIdentity = "identity"
)

// Headers a clustered node sets on every P.E.kv_events it publishes, so
// other nodes know whose pool the events describe (the body is vLLM's and
// names no node; routers ignore headers they do not know).
// HeaderGeometry is the fingerprint (16 hex digits) of the geometry of the
// namespace whose keys the batch's BlockStored and BlockRemoved events
// name: a node's batch holds one namespace's keys. A key means the same
// bytes only under the same geometry, so other nodes count a held key for
// an engine only when its namespace's geometry is the engine's
// (ClusterNamespace); a batch without it counts for nobody.
const (
	HeaderNode     = "Kvactors-Node"
	HeaderBoot     = "Kvactors-Boot"
	HeaderGeometry = "Kvactors-Geometry"
)

// Overloaded starts the error of a reply to a request the node's full
// intake dropped unread (PROTOCOL.md "Delivery", Overflow): the wire has no
// error code, so the engine SDK tells it by these words, and the node
// writes them from here.
const Overloaded = "node overloaded"

// Reply inboxes (PROTOCOL.md "kvactors' choice, replies").
const (
	// InboxRoot prefixes every reply inbox: nats.go's default inboxes and
	// the SDK's `_INBOX.<engine>.`.
	InboxRoot = "_INBOX."
	// ServiceUser is kvactors' own NATS user (natsauth.ServiceUser). It
	// starts with '_' so no engine id can take it; its inboxes,
	// `_INBOX._kvactors.`, are never a reply subject the node answers.
	ServiceUser = "_kvactors"
)

// serviceInboxes is the prefix of kvactors' own reply inboxes.
const serviceInboxes = InboxRoot + ServiceUser + "."

// ReplyAllowed reports whether the node may answer on reply: a reply inbox
// (under InboxRoot), never one of kvactors' own. The node answers with its
// own permissions, which cover every engine's subjects and its JetStream
// API: a sender that named `P.<other>.unregister` or `$KV.…` as its reply
// would make the node publish there for it. actors.Outbox.Reply, the one
// way the node answers, enforces it. A reply with a wildcard token (`*`,
// `>`) is none: the server delivers such a publish to every subscription
// that matches it as a literal (`_INBOX.vic.>` reaches vic's own wildcard
// subscription on its inboxes), a subject the sender may not publish on.
func ReplyAllowed(reply string) bool {
	return strings.HasPrefix(reply, InboxRoot) && !strings.HasPrefix(reply, serviceInboxes) && literal(reply)
}

// literal reports whether subject has no wildcard token.
func literal(subject string) bool {
	for tok := range strings.SplitSeq(subject, ".") {
		if tok == "*" || tok == ">" {
			return false
		}
	}
	return true
}

// EngineReplyAllowed reports whether the node may answer engine's message
// of verb on reply: ReplyAllowed, and for every verb but status (anyone may
// ask for status: routers, tools) under the engine's own inbox
// `_INBOX.<engine>.`, the only one NATS permissions let it read
// (client.InboxPrefix). Otherwise engine mal could have the node answer,
// with the node's rights, into engine vic's inbox.
func EngineReplyAllowed(engine, verb, reply string) bool {
	if !ReplyAllowed(reply) {
		return false
	}
	if verb == VerbStatus {
		return true
	}
	own, ok := strings.CutPrefix(reply[len(InboxRoot):], engine)
	return ok && engine != "" && strings.HasPrefix(own, ".")
}

// ValidPrefix reports whether p may be the subject prefix P: dot-separated
// tokens, none empty, without wildcards, spaces or control characters, and
// not under a namespace NATS reserves by convention (a first token starting
// with '_', as _INBOX, or '$', as $JS, $KV and $SYS): under _INBOX an
// engine's verb subjects would pass for reply inboxes (ReplyAllowed), and
// another node could be made to answer onto them.
func ValidPrefix(p string) bool {
	if p == "" || p[0] == '.' || p[0] == '_' || p[0] == '$' || p[len(p)-1] == '.' {
		return false
	}
	for i := 0; i < len(p); i++ {
		switch ch := p[i]; {
		case ch == '*' || ch == '>' || ch <= ' ' || ch == 0x7f:
			return false
		case ch == '.' && p[i-1] == '.':
			return false
		}
	}
	return true
}

// EngineSubject is P.E.verb.
func EngineSubject(prefix, engine, verb string) string { return prefix + "." + engine + "." + verb }

// NodeSubject is P._node.N.verb.
func NodeSubject(prefix, node, verb string) string {
	return prefix + "." + NodeToken + "." + node + "." + verb
}

// Hello is published on P._node.<node>.hello at start and after every
// reconnect of the node.
type Hello struct {
	Node    string `json:"node"`
	Boot    string `json:"boot"`
	LeaseMS int64  `json:"lease_ms"`
	// Starting is set only in an answer to P._node.<node>.identity, by a
	// process whose own start probe has not finished (PROTOCOL.md "Node
	// identity": of two starting at once, the lower boot goes on).
	Starting bool `json:"starting,omitempty"`
}

// NodeHeartbeat is published on P._node.<node>.heartbeat every lease/4.
// The usage fields are optional (older nodes omit them): `kvactors nodes`
// shows them.
type NodeHeartbeat struct {
	Node    string `json:"node"`
	Boot    string `json:"boot"`
	Engines int    `json:"engines"`
	// LeaseMS is the node's lease (as in its hello): another process with
	// the same node id counts a conflict for the longer of the two leases.
	LeaseMS int64 `json:"lease_ms,omitempty"`
	// PoolBytes is the host pool's bytes in use, PoolCapacityBytes its size,
	// DiskBytes the disk tier's bytes in use (0 without one).
	PoolBytes         int64 `json:"pool_bytes,omitempty"`
	PoolCapacityBytes int64 `json:"pool_capacity_bytes,omitempty"`
	DiskBytes         int64 `json:"disk_bytes,omitempty"`
}

// HeartbeatRequest is the body of P.E.heartbeat: the engine's epoch and the
// seq of the last batch it published in that epoch.
type HeartbeatRequest struct {
	Epoch string `json:"epoch"`
	Seq   uint64 `json:"seq"`
}

// HeartbeatReply answers P.E.heartbeat: the last batch seq the node applied
// in that epoch and how many releases it has published for that epoch.
type HeartbeatReply struct {
	Node     string `json:"node"`
	Boot     string `json:"boot"`
	Epoch    string `json:"epoch,omitempty"`
	Applied  uint64 `json:"applied"`
	Released uint64 `json:"released"`
	Error    string `json:"error,omitempty"`
}

// UnregisterReply answers P.E.unregister (body {}).
type UnregisterReply struct {
	OK       bool   `json:"ok,omitempty"`
	Released int    `json:"released"`
	Node     string `json:"node"`
	Boot     string `json:"boot"`
	Error    string `json:"error,omitempty"`
}

// Resync reasons.
const (
	ResyncGap       = "gap"       // a seq jump, a lost tail, or an epoch not starting at 1
	ResyncReconnect = "reconnect" // the node itself reconnected to NATS
	ResyncOverflow  = "overflow"  // the node's inbound queue could not take a batch
)

// Resync is published on P.E.resync: the node applies nothing more of Epoch;
// the engine must start a new epoch and re-announce its live requests.
type Resync struct {
	Node     string `json:"node"`
	Boot     string `json:"boot"`
	Epoch    string `json:"epoch"`
	Expected uint64 `json:"expected"`
	Got      uint64 `json:"got"`
	Reason   string `json:"reason"`
}

// KVAllBlocksCleared is published on P.E.kv_events before anything else at
// an engine's first register in a node's boot.
const KVAllBlocksCleared = "AllBlocksCleared"

// NamespaceKey is the identity of namespace name as engine names it: what
// the node's namespace table, the disk tier, the cluster's holder index and
// its fetch and keys messages key on. A name equal to the engine's own id
// (the default) is that engine's own namespace; any other name is a shared
// one, keyed with a leading '.' that no engine id has. So an engine that
// names another engine's id as its namespace joins a shared namespace of
// that name, never the other engine's own (PROTOCOL.md: an engine "shares
// with nobody unless it says so"). A kv_events batch on P.E.kv_events whose
// namespace is name has the key NamespaceKey(E, name): a namespace's events
// go on one of its members.
func NamespaceKey(engine, name string) string {
	if name == "" || name == engine {
		return engine
	}
	return "." + name
}

// ClusterNamespace is the identity of a namespace across a cluster's
// nodes: its key (NamespaceKey) qualified by the fingerprint of its
// geometry, as "<16 hex digits>:<key>". Each node fixes a namespace's
// geometry for its own boot only, so two nodes may hold one namespace with
// different geometries (a rolling change of KV dtype or block size that
// keeps the name), and a key of one names other bytes under the other. The
// cluster's holder index, its keys pages and its fetch requests key on
// this. No NamespaceKey has the form (an engine id has no ':', a shared
// key starts with '.'), so a key from a node that sends none (an older
// version) never matches one.
func ClusterNamespace(key string, geometry uint64) string {
	return GeometryHex(geometry) + ":" + key
}

// SplitClusterNamespace is the inverse of ClusterNamespace; false if s is
// not of its form.
func SplitClusterNamespace(s string) (key string, geometry uint64, ok bool) {
	fp, key, found := strings.Cut(s, ":")
	if !found || key == "" {
		return "", 0, false
	}
	g, ok := ParseGeometryHex(fp)
	if !ok {
		return "", 0, false
	}
	return key, g, true
}

// GeometryHex is a geometry fingerprint as HeaderGeometry carries it.
func GeometryHex(geometry uint64) string { return fmt.Sprintf("%016x", geometry) }

// ParseGeometryHex reads HeaderGeometry; false if it is not 16 hex digits.
func ParseGeometryHex(s string) (uint64, bool) {
	if len(s) != 16 {
		return 0, false
	}
	g, err := strconv.ParseUint(s, 16, 64)
	return g, err == nil
}
