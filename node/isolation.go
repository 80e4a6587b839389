package node

import (
	"crypto/sha256"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvactors/kvactors/backend"
	"github.com/kvactors/kvactors/ingest"
	"github.com/kvactors/kvactors/messages"
	"github.com/kvactors/kvactors/ratelog"
	"github.com/kvactors/kvactors/sched"
)

// ErrLimit wraps a register refused past a node bound (--max-engines,
// --max-mapped-segments, --max-mapped-bytes, --max-model-len, the
// namespaces of a boot); reject label "limit".
var ErrLimit = messages.NewRejection(messages.RejectLimit, "node limit reached")

// namespaces interns namespace names to the small ids that prefix pool keys
// (PROTOCOL.md "Isolation"). The first engine registered in a namespace
// fixes its geometry for the rest of the node's boot, whether or not that
// engine stays: the namespace's keys stay in the pool, and they must mean
// the same bytes to every engine that loads them. A namespace is forgotten
// with the engine id that opened it (departed.go), once it has no member:
// its id is never given out again within a boot, so a key can never change
// namespace, and its keys left in the pool are unreachable until evicted.
type namespaces struct {
	// mu guards the table against kvTarget, which runs on the kv_events
	// journal's goroutine and must not wait for n.mu, held by a register
	// across its device attach. Writers hold n.mu as well, so other readers
	// under n.mu need not take it.
	mu    sync.RWMutex
	byKey map[string]*namespace // by messages.NamespaceKey
	byID  map[sched.NamespaceID]*namespace
	last  sched.NamespaceID // the last id given out; 0 never is
	// member is each registered engine's namespace: the kv_events journal
	// asks it per record, off n.mu (see kvTarget).
	member map[string]sched.NamespaceID
	// opened counts the namespaces each engine id opened in this boot:
	// one engine may not use up the node's bound for everyone else.
	opened map[string]int
	// owned are the namespaces held that each engine id opened, or
	// adopted as the last member of one whose opener was forgotten: they
	// go with it (forget).
	owned map[string][]sched.NamespaceID
}

type namespace struct {
	id   sched.NamespaceID
	name string // as its engines name it (kv_events)
	key  string // messages.NamespaceKey: private to one engine, or shared
	// layout is a member's, for a register's detailed geometry check, held
	// only while the namespace has members: a spec may carry 64 groups of
	// 4096 regions (~7.6 MB of layout), and namespaces outlive their
	// engines (16 × --max-engines of them), so a memberless one keeps only
	// digest, which a register's geometry must match.
	layout *sched.Layout
	digest [sha256.Size]byte // geometryDigest of its geometry
	geo    uint64            // its fingerprint (geometry): the cluster's namespace identity includes it
	owner  string            // the engine id it is forgotten with (owned); "" while members outlive it
	// members are its registered engines, in the order they last
	// registered. The last one announces (announcer): evictions of its keys
	// caused by an engine of another namespace are announced on that
	// engine's kv_events, never on the evicter's (which would tell one
	// tenant another's block hashes). An engine that leaves (unregister,
	// expiry, failure, a cluster drop, a register into another namespace)
	// leaves this list, so it never hears of the namespace again.
	members []string
}

// announcer is the engine on whose kv_events changes to ns's keys that no
// member made are announced; "" when it has no member (the kv_events
// journal then defers them to the next engine that joins). Caller holds
// the table's mu.
func (ns *namespace) announcer() string {
	if len(ns.members) == 0 {
		return ""
	}
	return ns.members[len(ns.members)-1]
}

// maxNamespacesPerEngine bounds the table: each successful register may
// open a namespace, which lives until the id that opened it is forgotten.
// An engine id may open this many until then, and the node holds
// 16 × --max-engines in all.
const maxNamespacesPerEngine = 16

// namespacesMost is the node's bound on namespaces held for
// --max-engines engines: saturated, since a huge --max-engines (meant as
// "no bound") wrapped the product negative and refused every register.
func namespacesMost(engines int) int {
	if engines > math.MaxInt/maxNamespacesPerEngine {
		return math.MaxInt
	}
	return maxNamespacesPerEngine * engines
}

// check reports whether engine's lay may join namespace name, and its id
// (0 if the namespace is new: commit gives it one). Caller holds n.mu.
func (t *namespaces) check(engine, name string, lay *sched.Layout, most int) (sched.NamespaceID, error) {
	ns := t.byKey[messages.NamespaceKey(engine, name)]
	if ns == nil {
		if opened := t.opened[engine]; opened >= maxNamespacesPerEngine {
			return 0, fmt.Errorf("%w: engine %q opened %d namespaces since the node last forgot its id", ErrLimit, engine, opened)
		}
		if len(t.byID) >= most {
			return 0, fmt.Errorf("%w: %d namespaces held, each with a member or an engine id not yet forgotten", ErrLimit, len(t.byID))
		}
		return 0, nil
	}
	if ns.layout != nil {
		if err := ns.layout.SameGeometry(lay); err != nil {
			return 0, fmt.Errorf("%w: namespace %q: %w", ErrRegister, name, err)
		}
	} else if geometryDigest(lay) != ns.digest {
		return 0, fmt.Errorf("%w: namespace %q: its geometry (tokens_per_hash, blocks_per_chunk, each group's kind and tokens_per_block, each region's block_bytes) is not the one it holds",
			ErrRegister, name)
	}
	return ns.id, nil
}

// full reports whether a register of engine in namespace name needs a new
// namespace and the table holds most. Caller holds n.mu.
func (t *namespaces) full(engine, name string, most int) bool {
	return t.byKey[messages.NamespaceKey(engine, name)] == nil && len(t.byID) >= most
}

// commit records a successful register of engine in namespace name and
// returns the namespace.
func (t *namespaces) commit(name, engine string, lay *sched.Layout) *namespace {
	t.mu.Lock()
	defer t.mu.Unlock()
	key := messages.NamespaceKey(engine, name)
	ns := t.byKey[key]
	if ns == nil {
		if t.byKey == nil {
			t.byKey, t.byID, t.opened = map[string]*namespace{}, map[sched.NamespaceID]*namespace{}, map[string]int{}
			t.owned = map[string][]sched.NamespaceID{}
		}
		t.last++
		ns = &namespace{id: t.last, name: name, key: key, digest: geometryDigest(lay), geo: geometry(lay), owner: engine}
		t.byID[ns.id] = ns
		t.byKey[key] = ns
		t.opened[engine]++
		t.owned[engine] = append(t.owned[engine], ns.id)
	}
	// A register into another namespace leaves the old one first: the
	// engine must stop hearing of it (PROTOCOL.md "Isolation").
	t.leaveLocked(engine)
	if ns.layout == nil {
		ns.layout = lay // checked against digest (check): the same geometry
	}
	ns.members = append(ns.members, engine)
	if t.member == nil {
		t.member = map[string]sched.NamespaceID{}
	}
	t.member[engine] = ns.id
	return ns
}

// leave forgets a detached engine's membership (its namespace stays): the
// namespace's announcer passes to the member registered last before it,
// or to nobody. The last member of a namespace whose owner was forgotten
// adopts it: it is forgotten with that member's id.
func (t *namespaces) leave(engine string) {
	t.mu.Lock()
	t.leaveLocked(engine)
	t.mu.Unlock()
}

// leaveLocked is leave with t.mu held.
func (t *namespaces) leaveLocked(engine string) {
	id, ok := t.member[engine]
	if !ok {
		return
	}
	delete(t.member, engine)
	ns := t.byID[id]
	ns.members = slices.DeleteFunc(ns.members, func(m string) bool { return m == engine })
	if len(ns.members) > 0 {
		return
	}
	ns.layout = nil // its digest checks the next register
	if ns.owner == "" {
		ns.owner = engine
		t.owned[engine] = append(t.owned[engine], id)
	}
}

// forget drops what the table keeps of engine id, which departed.go
// forgets (not registered, nothing ending): the namespaces it owns that
// have no member now, and its count of those opened. One that still has
// members stays, its last member to leave its owner. It returns the
// namespaces dropped. Caller holds n.mu.
func (t *namespaces) forget(engine string) (gone []*namespace) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, id := range t.owned[engine] {
		ns := t.byID[id]
		if len(ns.members) > 0 {
			ns.owner = ""
			continue
		}
		delete(t.byID, id)
		delete(t.byKey, ns.key)
		gone = append(gone, ns)
	}
	delete(t.owned, engine)
	delete(t.opened, engine)
	return gone
}

// forgetNamespaces forgets the namespaces engine id owns with no member
// (namespaces.forget), as departed.go forgets the id: the disk tier's
// mapping of each (a namespace of that name and geometry opened again maps
// its chunks on disk to its new id), and the kv_events changes deferred
// for each (no engine joins it again). Caller holds n.mu.
func (n *Node) forgetNamespaces(id string) {
	for _, ns := range n.nss.forget(id) {
		n.diskKeys.forget(ns.id)
		n.kv.forgot(id, ns)
	}
}

// admit applies the node bounds to a register of spec replacing old (nil
// for a new engine), whose segments would map bytes (mapCharge), and
// refuses a shm segment another live engine maps. Caller holds n.mu.
//
// The name rule lets engine "e1" name "e1-kv-x", which engine "e1-kv" would
// name too (ids may contain '-'). Objects have one link, so one name is one
// object: refusing a name already mapped keeps two engines from ever sharing
// memory, whichever registered first (docs/SECURITY.md).
func (n *Node) admit(old *engineRec, spec *messages.EngineSpec, bytes int64) error {
	for _, seg := range spec.Segments {
		if seg.Shm == "" {
			continue
		}
		for id, rec := range n.engines {
			if rec == old {
				continue
			}
			for _, other := range rec.spec.Segments {
				if other.Shm == seg.Shm {
					return fmt.Errorf("%w: %w", ErrRegister,
						ingest.SpecError("shm %q is mapped by engine %q", seg.Shm, id))
				}
			}
		}
	}
	if old == nil && len(n.engines) >= n.cfg.MaxEngines {
		return fmt.Errorf("%w: %d engines registered (--max-engines)", ErrLimit, len(n.engines))
	}
	// The old engine's segments stay mapped until it has retired, so they
	// count until then: a burst of re-registers cannot overshoot.
	if m := n.mapped + len(spec.Segments); m > n.cfg.MaxMappedSegments {
		return fmt.Errorf("%w: %d segments mapped, %d more would pass %d (--max-mapped-segments)",
			ErrLimit, n.mapped, len(spec.Segments), n.cfg.MaxMappedSegments)
	}
	// n.mappedBytes <= MaxMappedBytes always, so the subtraction cannot wrap.
	if bytes > n.cfg.MaxMappedBytes-n.mappedBytes {
		return fmt.Errorf("%w: %d bytes of segments mapped, %d more would pass %d (--max-mapped-bytes)",
			ErrLimit, n.mappedBytes, bytes, n.cfg.MaxMappedBytes)
	}
	return nil
}

// sharesNoObject refuses an attachment of an object another live engine
// maps (not old, the engine's own record when it re-registers). admit
// compares names, but a name may change after its register: whoever may
// rename in the shm directory can give the victim's live object a name of
// its own (one link, no symlink), and the node would map the victim's
// memory for it. Caller holds n.mu.
func (n *Node) sharesNoObject(old *engineRec, segs []messages.Segment, dev backend.Attachment) error {
	mine, ok := dev.(backend.Objects)
	if !ok {
		return nil
	}
	objs := mine.Objects()
	if len(objs) == 0 {
		return nil
	}
	mapped := map[backend.Object]string{}
	for id, rec := range n.engines {
		if other, ok := rec.attached.(backend.Objects); ok && rec != old {
			for _, obj := range other.Objects() {
				if obj != (backend.Object{}) { // no identity (a cuda handle): nothing to compare
					mapped[obj] = id
				}
			}
		}
	}
	for i, obj := range objs {
		if id, ok := mapped[obj]; ok {
			return fmt.Errorf("%w: %w", ErrRegister,
				ingest.SpecError("shm %q is mapped by engine %q (under another name)", segs[i].Shm, id))
		}
	}
	return nil
}

// mapCharge is what attaching spans costs against --max-mapped-bytes: each
// segment's span rounded out to whole pages, which is what the shm backend
// maps (backend.SpanAttacher). A backend that maps segments whole (cuda:
// device allocations, which the driver maps whole) is charged from each
// segment's start to its span's end, at the least what it maps. An error
// (a span too large to round) wraps ErrLimit: no node could map it.
func (n *Node) mapCharge(spans []backend.Span) (int64, error) {
	_, partial := n.backend.(backend.SpanAttacher)
	page := int64(os.Getpagesize())
	var sum int64
	for i, s := range spans {
		if !partial {
			s.Off = 0
		}
		p, ok := s.Pages(page)
		if !ok || p.Len() > math.MaxInt64-sum {
			return 0, fmt.Errorf("%w: segment %d: span [%d, %d) overflows (--max-mapped-bytes)", ErrLimit, i, s.Off, s.End)
		}
		sum += p.Len()
	}
	return sum, nil
}

// mappedNow, mappedBytesNow and namespacesNow are read at scrape time.
func (n *Node) mappedNow() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.mapped
}

// requestStateNow is what every engine's requests hold of their state
// budgets: summed here, at scrape time, so that a charge touches only its
// own engine's counter.
func (n *Node) requestStateNow() int64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	var held int64
	for _, b := range n.stateBudgets {
		held += b.Held()
	}
	return held
}

func (n *Node) mappedBytesNow() int64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.mappedBytes
}

func (n *Node) namespacesNow() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return len(n.nss.byID)
}

// namespacesHeld lists the ids of the namespaces held, in order (the
// kv_events journal's clearAll: ids forgotten leave holes).
func (n *Node) namespacesHeld() []sched.NamespaceID {
	t := &n.nss
	t.mu.RLock()
	ids := slices.Collect(maps.Keys(t.byID))
	t.mu.RUnlock()
	slices.Sort(ids)
	return ids
}

// unmapped gives back the segment count and mapped bytes of a closed
// device.
func (n *Node) unmapped(segments int, bytes int64) {
	n.mu.Lock()
	n.mapped -= segments
	n.mappedBytes -= bytes
	n.mu.Unlock()
}

// embeddedOptions are the embedded server's options: from --nats-config
// when set (its listen address wins over --nats-host/--nats-port when it
// has one), else a plain loopback server. JetStream runs only when that
// file enables it or the node is clustered (--cluster, --standby-for: the
// ownership bucket needs it): nothing else needs it, and an open JetStream
// lets any client fill the node's disk.
func (c Config) embeddedOptions() (*server.Options, error) {
	opts := &server.Options{}
	if c.NATSConfig != "" {
		var err error
		if opts, err = server.ProcessConfigFile(c.NATSConfig); err != nil {
			return nil, fmt.Errorf("%w: --nats-config %s: %w", ErrConfig, c.NATSConfig, err)
		}
	}
	if opts.Host == "" {
		opts.Host = c.NATSHost
	}
	if opts.Port == 0 {
		opts.Port = c.NATSPort
	}
	if opts.MaxPayload == 0 {
		opts.MaxPayload = MaxPayload
	}
	if opts.MaxControlLine == 0 && c.NATSConfig == "" {
		// A message's subject and reply ride in nats.go's pending queue
		// uncounted by its byte limit (natsMsgCost): bound them here. Not
		// under a --nats-config, which may bring operator JWTs, whose
		// CONNECT lines the limit covers too.
		opts.MaxControlLine = MaxControlLine
	}
	if c.Clustered() {
		opts.JetStream = true // the ownership bucket (docs/CLUSTER.md)
	}
	if opts.JetStream && opts.SyncInterval == 0 {
		// Every write synced (the config file may say otherwise): a bucket
		// that loses its unsynced tail issues revisions again, and a
		// revision is the ownership's fencing token (docs/CLUSTER.md
		// "Durability"). Its writes are a few small records per lease.
		opts.SyncAlways = true
	}
	opts.NoSigs = true
	return opts, nil
}

// hasAuth reports whether the server options require clients to
// authenticate.
func hasAuth(o *server.Options) bool {
	return len(o.Users) > 0 || len(o.Nkeys) > 0 || o.Authorization != "" || o.Username != "" ||
		o.TrustedOperators != nil || len(o.TrustedKeys) > 0 || o.AuthCallout != nil
}

// beyondLoopback reports whether a listen host accepts more than loopback
// connections ("" and 0.0.0.0 are every interface; a name is resolved).
func beyondLoopback(host string) bool {
	if host == "localhost" {
		return false
	}
	if a, err := netip.ParseAddr(host); err == nil {
		return !a.IsLoopback()
	}
	ips, err := net.LookupIP(host)
	if err != nil || len(ips) == 0 {
		return true
	}
	for _, ip := range ips {
		if !ip.IsLoopback() {
			return true
		}
	}
	return false
}

// warnExposure warns once at start about listeners that let anyone who can
// reach them act without credentials (docs/SECURITY.md).
func (n *Node) warnExposure(embedded *server.Options) {
	if embedded != nil && beyondLoopback(embedded.Host) && !hasAuth(embedded) {
		n.log.Warn("embedded NATS listens beyond loopback without auth: any client that reaches it can act as any engine (use --nats-config, docs/SECURITY.md)",
			"host", embedded.Host, "port", embedded.Port)
	}
	if n.ln != nil {
		if host, _, err := net.SplitHostPort(n.cfg.HTTPAddr); err == nil && beyondLoopback(host) {
			n.log.Warn("admin HTTP listens beyond loopback and has no auth: anyone who reaches it reads metrics and engine status (docs/SECURITY.md)",
				"addr", n.HTTPAddr())
		}
	}
}

// natsLog routes the embedded server's log into the node's: notices at
// debug, warnings as warnings, errors through the rejection limiter. A
// client can make the server log an error per message it sends (every
// permissions violation is one), so those lines are rate-limited like any
// rejected input.
type natsLog struct {
	log    *slog.Logger
	reject *ratelog.Log
}

func (l natsLog) Noticef(format string, v ...any) {
	l.log.Debug(fmt.Sprintf(format, v...), "lib", "nats-server")
}
func (l natsLog) Warnf(format string, v ...any) {
	l.log.Warn(fmt.Sprintf(format, v...), "lib", "nats-server")
}
func (l natsLog) Fatalf(format string, v ...any) {
	l.log.Error(fmt.Sprintf(format, v...), "lib", "nats-server")
}
func (l natsLog) Errorf(format string, v ...any) {
	l.reject.Reject("nats_server", fmt.Sprintf(format, v...), "lib", "nats-server")
}
func (l natsLog) Debugf(string, ...any) {}
func (l natsLog) Tracef(string, ...any) {}
