package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/novox/mesh-provisioner/replay"
	"github.com/novox/mesh-provisioner/store"
)

func init() {
	extraCommands["export"] = func(ctx context.Context, m *Main, args []string) error {
		return (&ExportCommand{Stdout: m.Stdout, Stderr: m.Stderr}).Run(ctx, args)
	}
}

// ExportCommand writes the buckets' history to an archive for offline forensics.
type ExportCommand struct {
	Stdout, Stderr io.Writer

	nats  natsFlags
	state string
	out   string
	force bool
}

func (c *ExportCommand) flags() *flag.FlagSet {
	fs := flag.NewFlagSet("export", flag.ContinueOnError)
	fs.SetOutput(c.Stderr)
	c.nats.register(fs, nats.DefaultURL)
	fs.StringVar(&c.state, "state", "", "export the seat's local event log in this state dir, instead of the streams")
	fs.StringVar(&c.out, "out", "", "the archive file to write (required)")
	fs.BoolVar(&c.force, "force", false, "replace --out when it exists (it is replaced only once the new archive is complete)")
	fs.Usage = func() {
		fmt.Fprint(c.Stderr, `Usage: mesh-provisioner export --out FILE [--nats URL | --state DIR]

Writes the history of every bucket a seat reads (the provisioner's four and the plans' inputs:
mesh-host_modules, mesh-indexer_builds, composed-<node>), sequence, time, subject, headers and data of
every message, to an archive: zstd-compressed MessagePack records after a header that says what it
holds (format version, tool, buckets, first and last sequence of each, created time, and which points
it rebuilds exactly).
Read it anywhere with: mesh-provisioner replay ... --archive FILE

From the streams (the default) the records are the messages as stored, headers and all, and what the
buckets' history limits already dropped is missing. From --state, the records are the seat's event
log, which outlives the buckets' history; its headers are written again from each message's operation
(KV-Operation, Nats-Rollup, Nats-Marker-Reason). It works beside a running serve.

A composed-<node> bucket that cannot be read (a permission missing for its stream, no leader, its
consumer slot taken) does not stop an export from the streams: the archive is written without it (what
was read of it kept), lists it, and the export names it and exits 4. Any other bucket that cannot be
read fails it (exit 1, no archive).

The file is written beside FILE under a temporary name and renamed into place once complete, so an
interrupted export leaves no FILE. A FILE that exists already is kept unless --force is given.

Examples:
  mesh-provisioner export --nats nats://nats.mesh:4222 --out incident.mph
  mesh-provisioner export --state /var/lib/mesh-provisioner/state --out incident.mph

Flags:
`)
		fs.PrintDefaults()
	}
	return fs
}

// Run exports.
func (c *ExportCommand) Run(ctx context.Context, args []string) error {
	fs := c.flags()
	if err := parseNoArgs(fs, args); err != nil {
		return err
	}
	if c.out == "" {
		return &usageError{msg: "export needs --out FILE"}
	}
	if countSources(fs, c.state, "") > 1 {
		return &usageError{msg: "give one source: --state or --nats"}
	}
	if err := checkOut(c.out, c.force); err != nil {
		return err
	}
	// The copy of --state is a Pebble store: out of descriptors it stops as serve does (onFatal).
	replay.SetOnFatal(onFatal(nil, c.Stderr))
	tick, end := lazyBar(c.Stderr, "export")
	var h replay.ArchiveHeader
	var err error
	if c.state != "" {
		l, oerr := replay.OpenState(c.state)
		if oerr != nil {
			return oerr
		}
		defer l.Close()
		h, err = replay.ExportLog(ctx, l.DB, c.out, "mesh-provisioner "+Version, tick)
	} else {
		// A permission the user lacks ends the export at once, naming it, with no archive written. But
		// for one composed-<node> bucket's stream: the archive is written without it (replay.ExportNATS),
		// and the export names it and exits 4.
		c.nats.spareComposed = true
		var js jetstream.JetStream
		var done func()
		ctx, _, js, done, err = c.nats.openStreams(ctx, "mesh-provisioner export")
		if err != nil {
			return err
		}
		defer done()
		h, err = replay.ExportNATS(ctx, js, nil, c.out, "mesh-provisioner "+Version, tick)
		err = refused(ctx, err)
	}
	end()
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	var n uint64
	for _, b := range h.Buckets {
		n += b.Messages
		fmt.Fprintf(c.Stdout, "%-28s %8d messages  sequences %d..%d\n", b.Name, b.Messages, b.FirstSeq, b.LastSeq)
	}
	fmt.Fprintf(c.Stdout, "wrote %s: %d messages from %s\n", c.out, n, h.Source)
	if len(h.Unread) > 0 {
		for _, b := range h.Unread {
			fmt.Fprintf(c.Stderr, "not read: %s: %s\n", b, h.UnreadWhy[b])
		}
		return &incompleteError{did: "wrote " + c.out, buckets: h.Unread,
			then: "the archive lists them, and replay of it refuses those nodes' plans; export again once they can be read"}
	}
	return nil
}

// checkOut checks --out before anything is read: an export of a large mesh takes minutes, and its
// rename into place was where a directory or a missing parent showed. An archive already there is
// evidence someone kept, and is replaced only with --force. An archive inside a state dir is refused:
// everything in it is the program's (CONTRACT section 5), and a rebuild or an operator deleting it
// would take the evidence along.
func checkOut(out string, force bool) error {
	if state, ok := store.EnclosingStateDir(out); ok {
		return &usageError{msg: fmt.Sprintf("--out %s is inside the state dir %s, which is the program's alone (a rebuild replaces it, and deleting it must lose nothing): write the archive elsewhere", out, state)}
	}
	fi, err := os.Stat(out)
	switch {
	case err == nil && fi.IsDir():
		return &usageError{msg: fmt.Sprintf("--out %s is a directory: give the archive's file name", out)}
	case err == nil && !force:
		return &usageError{msg: fmt.Sprintf("--out %s exists: give another file, or --force to replace it", out)}
	case err == nil:
		return nil
	case !errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("--out: %w", err)
	}
	dir := filepath.Dir(out)
	if fi, err := os.Stat(dir); errors.Is(err, os.ErrNotExist) {
		return &usageError{msg: fmt.Sprintf("--out %s: the directory %s does not exist", out, dir)}
	} else if err == nil && !fi.IsDir() {
		return &usageError{msg: fmt.Sprintf("--out %s: %s is not a directory", out, dir)}
	}
	return nil
}
