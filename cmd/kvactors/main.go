// Command kvactors is the KV-cache offload service: serve runs a node, demo
// runs a node with a simulated engine and checks every byte, bench measures
// it, version prints the version.
package main

import (
	"fmt"
	"os"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

const usage = `kvactors: out-of-engine KV-cache offload service

usage: kvactors <command> [flags]

commands:
  serve     run a node (embedded NATS unless --nats)
  demo      run a node and a simulated engine, print what happened, check every byte
  bench     measure event throughput, latency, copy bandwidth and scale
  nodes     list the nodes of a cluster (node, boot, engines, pool and disk, last heartbeat)
  flags     print the serve flag table (Markdown, as in docs/CONFIG.md)
  nats-config  print a NATS server configuration isolating engines (docs/SECURITY.md)
  version   print the version

Run 'kvactors <command> --help' for a command's flags.
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var code int
	switch cmd, args := os.Args[1], os.Args[2:]; cmd {
	case "serve":
		code = serve(args)
	case "demo":
		code = demo(args)
	case "bench":
		code = bench(args)
	case "nodes":
		code = nodes(args)
	case "flags":
		code = flagsTable(args)
	case "nats-config":
		code = natsConfig(args)
	case "version", "--version", "-v":
		fmt.Println("kvactors", version)
	case "help", "--help", "-h":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "kvactors: unknown command %q\n\n%s", cmd, usage)
		code = 2
	}
	os.Exit(code)
}
