package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvactors/kvactors/cluster"
	"github.com/kvactors/kvactors/natsauth"
	"github.com/kvactors/kvactors/node"
)

// runNodes is `kvactors nodes`: it listens to node heartbeats for --wait,
// or for as long as the cluster's lease needs (cluster.SurveyWait of the
// ownership bucket's lease, or of a heard heartbeat's), joins them with
// the ownership bucket and prints one row per node (node, boot, engines
// reported and owned, pool and disk usage, age of the last heartbeat). No
// heartbeat heard at all is a failure (exit 1), said on stderr. The logic
// is cluster.Survey and cluster.WriteNodes.
func runNodes(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("nodes", flag.ContinueOnError)
	env := func(k, def string) string {
		if v, ok := os.LookupEnv(k); ok {
			return v
		}
		return def
	}
	url := fs.String("nats", env("KVACTORS_NATS", nats.DefaultURL), "NATS server or cluster URL(s)")
	prefix := fs.String("prefix", env("KVACTORS_PREFIX", node.DefaultConfig().Prefix), "subject prefix P")
	bucket := fs.String("cluster-bucket", env("KVACTORS_CLUSTER_BUCKET", cluster.DefaultConfig().Bucket), "ownership KV bucket")
	creds := fs.String("nats-creds", env("KVACTORS_NATS_CREDS", ""), "NATS credentials file")
	nkey := fs.String("nats-nkey", env("KVACTORS_NATS_NKEY", ""), "nkey seed file (kvactors' user of a kvactors nats-config configuration)")
	ca := fs.String("nats-ca", env("KVACTORS_NATS_CA", ""), "CA certificate file for NATS TLS")
	cert := fs.String("nats-cert", env("KVACTORS_NATS_CERT", ""), "client certificate for NATS TLS (with --nats-key)")
	key := fs.String("nats-key", env("KVACTORS_NATS_KEY", ""), "the --nats-cert certificate's key file")
	wait := fs.Duration("wait", 3*time.Second, "how long to listen for heartbeats at least; longer when the cluster's lease "+
		"needs it (lease/4 and a fifth of that again, from the ownership bucket or a heard heartbeat)")
	if code := parseExit("nodes", parseFlags(fs, args), fs, stdout, stderr,
		"NATS secrets, as for serve: NATS_USER, NATS_PASSWORD, NATS_TOKEN (environment only)."); code >= 0 {
		return code
	}
	// kvactors' inbox prefix: the one natsauth lets kvactors' user read, so
	// the survey's replies reach it under a generated configuration.
	opts := []nats.Option{nats.Name("kvactors nodes"), nats.CustomInboxPrefix(natsauth.InboxPrefix(natsauth.ServiceUser))}
	// The same credentials as serve, NATS_USER/NATS_PASSWORD/NATS_TOKEN
	// included (docs/OPERATIONS.md offers them for both); NATSURL: the TLS
	// files are used (a connection over TCP).
	auth := node.Config{NATSURL: *url, NATSCreds: *creds, NATSNKey: *nkey, NATSCA: *ca, NATSCert: *cert, NATSKey: *key}
	auth.NATSSecretsFromEnv()
	if err := node.CheckNATSURLs(*url); err != nil {
		return parseExit("nodes", err, fs, stdout, stderr)
	}
	if err := auth.CheckFiles(); err != nil {
		return parseExit("nodes", err, fs, stdout, stderr)
	}
	authOpts, err := auth.NATSAuthOptions()
	if err != nil {
		fmt.Fprintln(stderr, "kvactors nodes:", err)
		return exitUsage
	}
	opts = append(opts, authOpts...)
	// The survey's own deadline ends the listening (stretched by the
	// lease); ctx ends it early on a permissions violation. setup bounds
	// the bucket's reads.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	setup, cancelSetup := context.WithTimeout(ctx, 10*time.Second)
	defer cancelSetup()
	// A permissions violation (credentials that are not kvactors') cannot
	// heal by waiting: say so and stop at once.
	denied := make(chan error, 1)
	opts = append(opts, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrPermissionViolation) {
			select {
			case denied <- err:
			default:
			}
			cancel()
		}
	}))
	defer func() {
		select {
		case err := <-denied:
			fmt.Fprintln(stderr, "kvactors nodes: not kvactors' credentials?", err)
		default:
		}
	}()
	nc, err := nats.Connect(*url, opts...)
	if err != nil {
		fmt.Fprintln(stderr, "kvactors nodes:", err)
		return exitFailure
	}
	defer nc.Close()
	var table *cluster.OwnerTable
	listen, lease := *wait, time.Duration(0)
	if js, err := jetstream.New(nc); err == nil {
		table, err = cluster.WatchBucket(setup, js, *bucket)
		switch {
		case noJetStream(err):
			// No cluster can run here (serve --cluster needs JetStream), so
			// there is nothing to list, and an empty table would say "no
			// nodes" of the wrong server.
			fmt.Fprintf(stderr, "kvactors nodes: NATS at %s has no JetStream (not enabled on the server or for "+
				"this account), so no cluster registry (ownership bucket %s): kvactors nodes lists a cluster, "+
				"whose nodes (serve --cluster) need JetStream (docs/CLUSTER.md)\n", nc.ConnectedUrlRedacted(), *bucket)
			return exitFailure
		case errors.Is(err, jetstream.ErrBucketNotFound):
			fmt.Fprintf(stderr, "kvactors nodes: no ownership bucket %s: no clustered node has started\n", *bucket)
		case err != nil:
			fmt.Fprintln(stderr, "kvactors nodes: ownership:", err)
		default:
			defer table.Stop()
			// The bucket's TTL is every node's lease: a node heartbeats
			// every lease/4, which a shorter --wait would miss.
			if lease, err = cluster.BucketLease(setup, js, *bucket); err != nil {
				fmt.Fprintln(stderr, "kvactors nodes: the cluster's lease not read (listening for --wait):", err)
			}
			listen = max(listen, cluster.SurveyWait(lease))
		}
	}
	rows, err := cluster.Survey(ctx, nc, *prefix, table, listen)
	if err != nil {
		fmt.Fprintln(stderr, "kvactors nodes:", err)
		return exitFailure
	}
	heard := 0
	for _, r := range rows {
		if r.Age >= 0 {
			heard++
		}
	}
	if len(rows) > 0 { // owners whose heartbeats stopped are still listed
		if err := cluster.WriteNodes(stdout, rows); err != nil {
			fmt.Fprintln(stderr, "kvactors nodes:", err)
			return exitFailure
		}
	}
	if heard == 0 {
		why := fmt.Sprintf("no node runs there, or the nodes have another --prefix or a lease over %v "+
			"(they heartbeat every lease/4: pass a longer --wait)", listen*4)
		if lease > 0 {
			why = fmt.Sprintf("the cluster's nodes (lease %v) heartbeat every %v: none runs there, or they have "+
				"another --prefix", lease, lease/4)
		}
		fmt.Fprintf(stderr, "kvactors nodes: no node heartbeat heard in %v on %s (prefix %q): %s\n",
			listen, nc.ConnectedUrlRedacted(), *prefix, why)
		return exitFailure
	}
	return exitOK
}

// noJetStream: the server (or account) has no JetStream; nothing answers its
// API, which nats.go reports as no responders.
func noJetStream(err error) bool {
	return errors.Is(err, jetstream.ErrJetStreamNotEnabled) ||
		errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount) || errors.Is(err, nats.ErrNoResponders)
}
