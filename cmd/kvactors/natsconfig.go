package main

import (
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/kvactors/kvactors/natsauth"
	"github.com/kvactors/kvactors/node"
)

// natsConfig is `kvactors nats-config`: it prints a nats-server
// configuration that isolates the listed engines (docs/SECURITY.md) and
// writes it with one secret file per user into --out.
func natsConfig(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("nats-config", flag.ContinueOnError)
	var o natsauth.Options
	engines := fs.String("engines", "", "comma-separated engine ids, one user each (required)")
	routers := fs.String("routers", "", "comma-separated router ids: read-only users (kv_events, status)")
	out := fs.String("out", "", "directory for nats-server.conf and the secret files (required; created 0700)")
	fs.StringVar(&o.Prefix, "prefix", node.DefaultConfig().Prefix, "subject prefix P")
	fs.StringVar(&o.Auth, "auth", natsauth.AuthNKey, "nkey (the config holds public keys) or password (bcrypt hashes)")
	fs.BoolVar(&o.JetStream, "jetstream", false, "enable JetStream (needed by serve --cluster), its API for kvactors' user only")
	fs.StringVar(&o.TLSCert, "tls-cert", "", "server certificate file (requires --tls-key)")
	fs.StringVar(&o.TLSKey, "tls-key", "", "server key file")
	fs.StringVar(&o.TLSCA, "tls-ca", "", "CA file: also verify client certificates")
	fs.IntVar(&o.MaxConnections, "max-connections", natsauth.DefaultMaxConnections,
		"the server's client connections, every user's together (max_connections)")
	fs.IntVar(&o.MaxSubscriptions, "max-subscriptions", natsauth.DefaultMaxSubscriptions,
		"subscriptions on one connection (max_subscriptions; an SDK engine holds one per load in flight, and 7)")
	if code := parseExit("nats-config", parseFlags(fs, args), fs, stdout, stderr); code >= 0 {
		return code
	}
	if *engines == "" || *out == "" {
		fmt.Fprintln(stderr, "kvactors nats-config: --engines and --out are required (see kvactors nats-config --help)")
		return exitUsage
	}
	o.Engines = split(*engines)
	o.Routers = split(*routers)
	if len(o.Engines) == 0 {
		fmt.Fprintf(stderr, "kvactors nats-config: --engines %q names no engine (see kvactors nats-config --help)\n", *engines)
		return exitUsage
	}
	g, err := natsauth.Generate(o)
	if err != nil {
		fmt.Fprintln(stderr, "kvactors nats-config:", err)
		return exitUsage
	}
	paths, err := g.Write(*out)
	if err != nil {
		fmt.Fprintln(stderr, "kvactors nats-config:", err)
		return exitFailure
	}
	fmt.Fprint(stdout, g.Config)
	conf := *out + "/" + natsauth.ConfigFile
	fmt.Fprintf(stderr, "wrote %s\n", strings.Join(paths, ", "))
	// kvactors' login: its seed file, or its password from the environment.
	env, login := "", fmt.Sprintf(" --nats-nkey %s/%s.nk", *out, natsauth.ServiceUser)
	if o.Auth == natsauth.AuthPassword {
		env, login = fmt.Sprintf("NATS_USER=%s NATS_PASSWORD=\"$(cat %s/%s.password)\" ", natsauth.ServiceUser, *out,
			natsauth.ServiceUser), ""
	}
	// The rest serve needs to be let in: the permissions' prefix; over TCP
	// (--nats URL) with TLS, the CA that signed the server's certificate,
	// with a client certificate of its own when the server verifies
	// clients'. The embedded server's own node needs neither: its
	// connection is in-process, plain. nats-config knows neither file: the
	// hint names them by placeholders, explained.
	if o.Prefix != node.DefaultConfig().Prefix {
		login += " --prefix " + o.Prefix
	}
	if !o.JetStream {
		fmt.Fprintf(stderr, "serve with: %skvactors serve --nats-config %s%s\n", env, conf, login)
		return exitOK
	}
	var notes []string
	tcpLogin := login
	if o.TLSCert != "" {
		tcpLogin += " --nats-ca CA.pem"
		notes = append(notes, "CA.pem: the CA that signed "+o.TLSCert)
	}
	if o.TLSCA != "" {
		tcpLogin += " --nats-cert CERT.pem --nats-key KEY.pem"
		notes = append(notes, "CERT.pem, KEY.pem: kvactors' client certificate and its key, signed by a CA in "+o.TLSCA)
	}
	// JetStream is for serve --cluster (docs/CLUSTER.md): on one host
	// the embedded server loaded from the file; across hosts a NATS
	// cluster whose servers run the file, with a cluster {} block of
	// their own.
	fmt.Fprintf(stderr, "serve a cluster on one host (embedded NATS) with: %skvactors serve --nats-config %s%s --cluster\n",
		env, conf, login)
	fmt.Fprintf(stderr, "or on NATS servers each run with nats-server -c %s (add a cluster {} block for their routes): "+
		"%skvactors serve --nats URL%s --cluster --cluster-replicas 3\n", conf, env, tcpLogin)
	// Each server of such a cluster takes the connections of every
	// host that may reach it, not one host's: the default is sized for one.
	maxConns := o.MaxConnections
	if maxConns == 0 {
		maxConns = natsauth.DefaultMaxConnections
	}
	fmt.Fprintf(stderr, "  (max_connections %d (--max-connections) is per server: size it for the engines, "+
		"nodes and routers that may connect to one)\n", maxConns)
	if len(notes) > 0 {
		fmt.Fprintf(stderr, "  (%s)\n", strings.Join(notes, "; "))
	}
	return exitOK
}

func split(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
