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
	wait := fs.Duration("wait", 3*time.Second, "how long to listen for heartbeats (at least lease/4)")
	if code := parseExit("nodes", parseFlags(fs, args), fs, stdout, stderr); code >= 0 {
		return code
	}
	opts := []nats.Option{nats.Name("kvactors nodes")}
	if *creds != "" {
		opts = append(opts, nats.UserCredentials(*creds))
	}
	nc, err := nats.Connect(*url, opts...)
	if err != nil {
		fmt.Fprintln(stderr, "kvactors nodes:", err)
		return exitFailure
	}
	defer nc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), *wait+10*time.Second)
	defer cancel()
	var table *cluster.OwnerTable
	if js, err := jetstream.New(nc); err == nil {
		table, err = cluster.WatchBucket(ctx, js, *bucket)
		switch {
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
