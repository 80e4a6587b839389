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
// joins them with the ownership bucket and prints one row per node (node,
// boot, engines reported and owned, pool and disk usage, age of the last
// heartbeat). The logic is cluster.Survey and cluster.WriteNodes.
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
	wait := fs.Duration("wait", 3*time.Second, "how long to listen for heartbeats (at least lease/4)")
	if code := parseExit("nodes", parseFlags(fs, args), fs, stdout, stderr,
		"NATS secrets, as for serve: NATS_USER, NATS_PASSWORD, NATS_TOKEN (environment only)."); code >= 0 {
		return code
	}
	// kvactors' inbox prefix: the one natsauth lets kvactors' user read, so
	// the survey's replies reach it under a generated configuration.
	opts := []nats.Option{nats.Name("kvactors nodes"), nats.CustomInboxPrefix(natsauth.InboxPrefix(natsauth.ServiceUser))}
	// The same credentials as serve, NATS_USER/NATS_PASSWORD/NATS_TOKEN
	// included (docs/OPERATIONS.md offers them for both).
	auth := node.Config{NATSCreds: *creds, NATSNKey: *nkey, NATSCA: *ca}
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
	ctx, cancel := context.WithTimeout(context.Background(), *wait+10*time.Second)
	defer cancel()
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
	if js, err := jetstream.New(nc); err == nil {
		table, err = cluster.WatchBucket(ctx, js, *bucket)
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
		}
	}
	rows, err := cluster.Survey(ctx, nc, *prefix, table, *wait)
	if err != nil {
		fmt.Fprintln(stderr, "kvactors nodes:", err)
		return exitFailure
	}
	if err := cluster.WriteNodes(stdout, rows); err != nil {
		fmt.Fprintln(stderr, "kvactors nodes:", err)
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
