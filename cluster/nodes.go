package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvactors/kvactors/messages"
)

// HeartbeatUsage is a node heartbeat with the usage fields `kvactors nodes`
// shows (optional fields of messages.NodeHeartbeat).
type HeartbeatUsage = messages.NodeHeartbeat

// NodeRow is one line of `kvactors nodes`.
type NodeRow struct {
	Node    string
	Boot    string   // "" if no heartbeat was heard
	Engines []string // owned in the ownership bucket
	// Reported is the engine count of the last heartbeat (-1: none heard).
	Reported int
	Usage    HeartbeatUsage
	// Age is the age of the last heartbeat heard at the end of the survey;
	// -1 if none was heard.
	Age time.Duration
}

// Survey listens to node heartbeats for wait (at least a heartbeat period,
// lease/4, to hear every live node) and joins them with the owners in
// table (nil: none), one row per node, sorted by node id. A node that owns
// engines and sent no heartbeat is listed with Age -1: its lease is
// running out.
func Survey(ctx context.Context, nc *nats.Conn, prefix string, table *OwnerTable, wait time.Duration) ([]NodeRow, error) {
	type heard struct {
		hb HeartbeatUsage
		at time.Time
	}
	var (
		mu   sync.Mutex
		last = map[string]heard{}
	)
	subj := messages.NodeSubject(prefix, "*", messages.NodeVerbHeartbeat)
	sub, err := nc.Subscribe(subj, func(m *nats.Msg) {
		var hb HeartbeatUsage
		if json.Unmarshal(m.Data, &hb) != nil || hb.Node == "" {
			return // not a heartbeat: nothing to show
		}
		mu.Lock()
		last[hb.Node] = heard{hb, time.Now()}
		mu.Unlock()
	})
	if err != nil {
		return nil, fmt.Errorf("subscribe %s: %w", subj, err)
	}
	defer func() { _ = sub.Unsubscribe() }()
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-timer.C:
	}
	end := time.Now()
	mu.Lock()
	defer mu.Unlock()
	rows := map[string]*NodeRow{}
	for node, h := range last {
		rows[node] = &NodeRow{Node: node, Boot: h.hb.Boot, Reported: h.hb.Engines, Usage: h.hb, Age: end.Sub(h.at)}
	}
	if table != nil {
		for node, engines := range table.ByNode() {
			r := rows[node]
			if r == nil {
				r = &NodeRow{Node: node, Reported: -1, Age: -1}
				rows[node] = r
			}
			r.Engines = engines
		}
	}
	out := make([]NodeRow, 0, len(rows))
	for _, r := range rows {
		out = append(out, *r)
	}
	slices.SortFunc(out, func(a, b NodeRow) int { return strings.Compare(a.Node, b.Node) })
	return out, nil
}

// WriteNodes prints rows as the `kvactors nodes` table.
func WriteNodes(w io.Writer, rows []NodeRow) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tBOOT\tENGINES\tOWNED\tPOOL\tDISK\tLAST HEARTBEAT")
	for _, r := range rows {
		boot, reported, age := r.Boot, fmt.Sprint(r.Reported), r.Age.Round(time.Millisecond).String()+" ago"
		if r.Age < 0 {
			boot, reported, age = "-", "-", "none (lease running out)"
		}
		owned := strings.Join(r.Engines, ",")
		if owned == "" {
			owned = "-"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Node, boot, reported, owned,
			usage(r.Usage.PoolBytes, r.Usage.PoolCapacityBytes), usage(r.Usage.DiskBytes, 0), age)
	}
	return tw.Flush()
}

func usage(used, capacity int64) string {
	switch {
	case used == 0 && capacity == 0:
		return "-"
	case capacity == 0:
		return mib(used)
	}
	return mib(used) + "/" + mib(capacity)
}

func mib(b int64) string { return fmt.Sprintf("%.1fMiB", float64(b)/(1<<20)) }
