package natsauth

import (
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/nats-io/nkeys"
	"golang.org/x/crypto/bcrypt"

	"github.com/kvactors/kvactors/client"
	"github.com/kvactors/kvactors/messages"
)

// Auth kinds.
const (
	AuthNKey     = "nkey"     // the config holds public keys; each user keeps a seed
	AuthPassword = "password" // the config holds bcrypt hashes; each user keeps a password
)

// ServiceUser is kvactors' own user name. It starts with '_' so no engine
// id can take it, and names kvactors' reply inboxes (InboxPrefix).
const ServiceUser = messages.ServiceUser

// Options says what to generate.
type Options struct {
	// Prefix is the subject prefix P (default "kvactors").
	Prefix string
	// Engines are the engine ids that get a user each.
	Engines []string
	// Routers get read-only users: kv_events of every engine, node hellos
	// and heartbeats, and P.*.status requests.
	Routers []string
	// Auth is AuthNKey (default) or AuthPassword.
	Auth string
	// JetStream turns on the server's JetStream (off otherwise); only
	// kvactors' user may use its API.
	JetStream bool
	// TLSCert and TLSKey, when set, make the server require TLS with them;
	// TLSCA verifies client certificates too when set.
	TLSCert, TLSKey, TLSCA string
	// MaxConnections bounds the server's client connections, every user's
	// together (0: DefaultMaxConnections); MaxSubscriptions bounds each
	// connection's subscriptions (0: DefaultMaxSubscriptions). nats-server's
	// configuration file has no per-user bound: these are the server's.
	MaxConnections, MaxSubscriptions int
	// BcryptCost is the password hashes' cost (0: bcrypt.DefaultCost). The
	// server pays it at every connect; tests lower it.
	BcryptCost int
}

// Bounds written by default. Without them one engine, with its own
// credentials only, grew the server's process (kvactors' own, embedded) by
// hundreds of MB and thousands of descriptors: 300,000 subscriptions on its
// inboxes took 440 MB (about 1.5 KB each; docs/SECURITY.md "Bounds").
const (
	// DefaultMaxConnections: one host's engines (a few per GPU), its
	// routers, kvactors' own connection and a `kvactors nodes` or two need
	// tens; a NATS cluster that many hosts share may need more (nats-config
	// --max-connections).
	DefaultMaxConnections = 256
	// DefaultMaxSubscriptions: the Go SDK holds 5 subscriptions, nats.go's
	// response inbox, one per heartbeat awaiting its reply and one per load
	// until its reply comes (or the node's loss settles it), so its loads
	// in flight bound it: twice vLLM's largest usual max_num_seqs (1024).
	// kvactors' own connection holds about 20.
	DefaultMaxSubscriptions = 2048
)

// Credential is one user's secret: what its client presents.
type Credential struct {
	User     string // engine id, router id, or ServiceUser
	Role     string // "kvactors", "engine" or "router"
	Seed     string // nkey seed (AuthNKey)
	Password string // plaintext (AuthPassword); the config holds its hash
}

// Generated is a configuration and the secrets that go with it.
type Generated struct {
	Config string
	Creds  []Credential
}

var idRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,64}$`)

// ErrOptions wraps every reason Generate refuses its options.
var ErrOptions = errors.New("natsauth: bad options")

// InboxPrefix is the reply-inbox prefix user id must set in its NATS
// client: the only inboxes it may subscribe to. It is the engine SDK's
// (client.Dial sets it), so the two cannot drift.
func InboxPrefix(id string) string { return client.InboxPrefix(id) }

// Generate makes fresh credentials for every user and the configuration
// that grants each its permissions.
func Generate(o Options) (Generated, error) {
	if o.Prefix == "" {
		o.Prefix = "kvactors"
	}
	if o.Auth == "" {
		o.Auth = AuthNKey
	}
	if o.Auth != AuthNKey && o.Auth != AuthPassword {
		return Generated{}, fmt.Errorf("%w: auth %q: want %s or %s", ErrOptions, o.Auth, AuthNKey, AuthPassword)
	}
	if !messages.ValidPrefix(o.Prefix) {
		return Generated{}, fmt.Errorf("%w: prefix %q", ErrOptions, o.Prefix)
	}
	if o.BcryptCost != 0 && (o.BcryptCost < bcrypt.MinCost || o.BcryptCost > bcrypt.MaxCost) {
		return Generated{}, fmt.Errorf("%w: bcrypt cost %d: want %d..%d", ErrOptions, o.BcryptCost, bcrypt.MinCost, bcrypt.MaxCost)
	}
	if o.MaxConnections == 0 {
		o.MaxConnections = DefaultMaxConnections
	}
	if o.MaxSubscriptions == 0 {
		o.MaxSubscriptions = DefaultMaxSubscriptions
	}
	if o.MaxConnections < 0 || o.MaxSubscriptions < 0 {
		return Generated{}, fmt.Errorf("%w: max connections %d, max subscriptions %d: want at least 1",
			ErrOptions, o.MaxConnections, o.MaxSubscriptions)
	}
	if (o.TLSCert == "") != (o.TLSKey == "") {
		return Generated{}, fmt.Errorf("%w: TLS needs both a certificate and a key", ErrOptions)
	}
	seen := map[string]bool{}
	for _, id := range append(append([]string(nil), o.Engines...), o.Routers...) {
		switch {
		case !idRE.MatchString(id) || id[0] == '_':
			return Generated{}, fmt.Errorf("%w: id %q: want [A-Za-z0-9_-]{1,64}, not starting with '_'", ErrOptions, id)
		case seen[id]:
			return Generated{}, fmt.Errorf("%w: id %q listed twice", ErrOptions, id)
		}
		seen[id] = true
	}
	var g Generated
	var users []string
	add := func(id, role string, perms string) error {
		c := Credential{User: id, Role: role}
		var auth string
		switch o.Auth {
		case AuthNKey:
			kp, err := nkeys.CreateUser()
			if err != nil {
				return fmt.Errorf("natsauth: nkey for %s: %w", id, err)
			}
			seed, _ := kp.Seed()
			pub, _ := kp.PublicKey()
			c.Seed = string(seed)
			auth = "nkey: " + quote(pub)
		case AuthPassword:
			var b [24]byte
			_, _ = rand.Read(b[:]) // crypto/rand.Read never fails
			c.Password = base64.RawURLEncoding.EncodeToString(b[:])
			cost := o.BcryptCost
			if cost == 0 {
				cost = bcrypt.DefaultCost
			}
			hash, err := bcrypt.GenerateFromPassword([]byte(c.Password), cost)
			if err != nil {
				return fmt.Errorf("natsauth: hash for %s: %w", id, err)
			}
			auth = "user: " + quote(id) + ", password: " + quote(string(hash))
		}
		g.Creds = append(g.Creds, c)
		users = append(users, fmt.Sprintf("    # %s %s\n    { %s,\n      permissions: %s }", role, id, auth, perms))
		return nil
	}
	if err := add(ServiceUser, "kvactors", servicePerms(o)); err != nil {
		return Generated{}, err
	}
	for _, id := range o.Engines {
		if err := add(id, "engine", enginePerms(o.Prefix, id)); err != nil {
			return Generated{}, err
		}
	}
	for _, id := range o.Routers {
		if err := add(id, "router", routerPerms(o.Prefix, id)); err != nil {
			return Generated{}, err
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, "# nats-server configuration for kvactors (generated by `kvactors nats-config`).\n")
	fmt.Fprintf(&b, "# Subject prefix %q. Each engine may publish only on %s.<id>.> (not the verbs kvactors\n", o.Prefix, o.Prefix)
	fmt.Fprintf(&b, "# publishes there: released, stored, kv_events, resync) and read only its\n")
	fmt.Fprintf(&b, "# own subjects, node hellos and heartbeats, and its inboxes _INBOX.<id>.> (clients\n")
	fmt.Fprintf(&b, "# must set that inbox prefix). See docs/SECURITY.md.\n\n")
	b.WriteString("# A message's subject and reply: kvactors' take a few hundred bytes, and the\n" +
		"# node's intake budget counts each message queued for it at this much.\n" +
		"max_control_line: 2048\n\n")
	fmt.Fprintf(&b, "# Bounds on what any user may make of the server's memory and descriptors\n"+
		"# (the embedded server's are kvactors' own): client connections, every user's\n"+
		"# together; subscriptions on one connection (the Go SDK holds one per load in\n"+
		"# flight and about 7 more). See docs/SECURITY.md \"Bounds\".\n"+
		"max_connections: %d\nmax_subscriptions: %d\n\n", o.MaxConnections, o.MaxSubscriptions)
	if o.JetStream {
		b.WriteString("# JetStream: only kvactors' user may use its API. Every write synced: the\n" +
			"# ownership bucket's revisions fence its owners, and a server that lost its\n" +
			"# unsynced tail would issue them again (docs/CLUSTER.md \"Durability\").\n" +
			"jetstream {\n  sync_interval: always\n}\n\n")
	} else {
		b.WriteString("# No jetstream block: JetStream is off.\n\n")
	}
	if o.TLSCert != "" {
		fmt.Fprintf(&b, "tls {\n  cert_file: %s\n  key_file: %s\n", quote(o.TLSCert), quote(o.TLSKey))
		if o.TLSCA != "" {
			fmt.Fprintf(&b, "  ca_file: %s\n  verify: true\n", quote(o.TLSCA))
		}
		b.WriteString("}\n\n")
	}
	b.WriteString("authorization {\n  users = [\n")
	b.WriteString(strings.Join(users, ",\n"))
	b.WriteString("\n  ]\n}\n")
	g.Config = b.String()
	return g, nil
}

// quote renders s as a double-quoted string of nats-server's configuration
// syntax, which reads back exactly s. strconv.Quote is not that syntax: its
// \a, \u2028 and the like are escapes the server's parser refuses, so a TLS
// path or a prefix holding such a character made a file the server would
// not start with. The parser knows \", \\ and \xXX (a byte), so every
// byte but printable ASCII is written as \xXX.
func quote(s string) string {
	const digits = "0123456789abcdef"
	b := make([]byte, 0, len(s)+2)
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c < ' ' || c > '~':
			b = append(b, '\\', 'x', digits[c>>4], digits[c&0xf])
		default:
			b = append(b, c)
		}
	}
	return string(append(b, '"'))
}

// list renders subjects as a config array.
func list(subjects ...string) string {
	q := make([]string, len(subjects))
	for i, s := range subjects {
		q[i] = quote(s)
	}
	return "[" + strings.Join(q, ", ") + "]"
}

// servicePerms: kvactors takes every P.<engine>.<verb> through one
// subscription to P.*.* (one engine's messages keep their order across
// verbs), so its user may read all of them; the point of the configuration
// is that no other user may.
func servicePerms(o Options) string {
	subs := []string{o.Prefix + ".*.*", o.Prefix + "." + messages.NodeToken + ".>", InboxPrefix(ServiceUser) + ".>"}
	pubs := []string{o.Prefix + ".>"}
	if o.JetStream { // the API, acks of what it consumes, KV puts (cluster ownership)
		pubs = append(pubs, "$JS.API.>", "$JS.ACK.>", "$KV.>")
	}
	return fmt.Sprintf("{\n        publish: { allow: %s }\n        subscribe: { allow: %s }\n        allow_responses: true }",
		list(pubs...), list(subs...))
}

// enginePerms: an engine publishes its own verbs only. The verbs kvactors
// publishes on an engine's subjects (released, stored, kv_events, resync)
// are denied to it, though they are its own: other nodes and routers trust
// P.<engine>.kv_events as a node's account of its pool, so an engine that
// could publish there could forge holdings in other tenants' namespaces.
func enginePerms(prefix, id string) string {
	node := prefix + "." + messages.NodeToken + ".*."
	own := prefix + "." + id + "."
	deny := make([]string, len(NodeOnlyVerbs))
	for i, v := range NodeOnlyVerbs {
		deny[i] = own + v
	}
	return fmt.Sprintf("{\n        publish: { allow: %s, deny: %s }\n        subscribe: { allow: %s } }",
		list(own+">"), list(deny...),
		list(own+">", node+messages.NodeVerbHello, node+messages.NodeVerbHeartbeat, InboxPrefix(id)+".>"))
}

// NodeOnlyVerbs are the verbs only kvactors publishes on P.<engine>.<verb>.
var NodeOnlyVerbs = []string{messages.VerbReleased, messages.VerbStored, messages.VerbKVEvents, messages.VerbResync}

func routerPerms(prefix, id string) string {
	node := prefix + "." + messages.NodeToken + ".*."
	return fmt.Sprintf("{\n        publish: { allow: %s }\n        subscribe: { allow: %s } }",
		list(prefix+".*."+messages.VerbStatus),
		list(prefix+".*."+messages.VerbKVEvents, node+messages.NodeVerbHello, node+messages.NodeVerbHeartbeat,
			InboxPrefix(id)+".>"))
}
