package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"cloud.google.com/go/compute/metadata"
	"github.com/urfave/cli/v2"
	"golang.org/x/oauth2"
	"google.golang.org/api/idtoken"

	"github.com/sandgate/sandgate/appliance"
	"github.com/sandgate/sandgate/appliance/cluster"
)

// shardFlags are serve's settings for several services sharing one store.
func shardFlags() []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "shard-id", Usage: "this service's shard `ID` among those sharing the store (default: $K_SERVICE on Cloud Run, else the host name)", EnvVars: []string{"SANDGATE_SHARD_ID"}},
		&cli.StringFlag{Name: "shard-peers", Usage: "forward requests, and this shard's credentials, only to the shards at these `ORIGINS` (http(s)://host[:port], comma-separated; a host may begin with *. for one label); unset: loopback shards only", EnvVars: []string{"SANDGATE_SHARD_PEERS"}},
		&cli.StringFlag{Name: "shard-url", Usage: "the `URL` the other shards reach this one at (default on Cloud Run: the service's own; required elsewhere when shards share the store)", EnvVars: []string{"SANDGATE_SHARD_URL"}},
		&cli.DurationFlag{Name: "lease-time", Value: cluster.DefaultLeaseTime, Usage: "a shard's leases hold this `DURATION` past its last heartbeat; another shard takes its sandboxes after", EnvVars: []string{"SANDGATE_LEASE_TIME"}},
		&cli.DurationFlag{Name: "lease-renew", Value: cluster.DefaultRenew, Usage: "renew the heartbeat every `DURATION` (at most a third of --lease-time)", EnvVars: []string{"SANDGATE_LEASE_RENEW"}},
		&cli.DurationFlag{Name: "checkpoint-interval", Value: appliance.DefaultCheckpointInterval, Usage: "save running sandboxes that changed every `DURATION` (as delta layers, without stopping them): what a crash of the service can lose; 0 never", EnvVars: []string{"SANDGATE_CHECKPOINT_INTERVAL"}},
	}
}

// shardConfig reads the shard settings. On Cloud Run the id defaults to
// the service's name and the URL to its own (from the metadata server).
func shardConfig(c *cli.Context, cloudRun bool, logger *slog.Logger) (appliance.ShardConfig, error) {
	sc := appliance.ShardConfig{ID: c.String("shard-id"), URL: c.String("shard-url"), LeaseTime: c.Duration("lease-time"), Renew: c.Duration("lease-renew")}
	if sc.LeaseTime <= 0 || sc.Renew <= 0 || sc.Renew > sc.LeaseTime/3 {
		return sc, badInput("SANDGATE_LEASE_TIME %s and SANDGATE_LEASE_RENEW %s: want both positive, renewal at most a third of the lease time (default 30s and 10s)", sc.LeaseTime, sc.Renew)
	}
	if c.Duration("checkpoint-interval") < 0 {
		return sc, badInput("SANDGATE_CHECKPOINT_INTERVAL: want a duration such as 5m, or 0 for none")
	}
	if sc.ID == "" && cloudRun {
		sc.ID = os.Getenv("K_SERVICE")
	}
	if sc.ID != "" {
		if err := cluster.CheckID(sc.ID); err != nil {
			return sc, badInput("SANDGATE_SHARD_ID (--shard-id): %v", err)
		}
	}
	if sc.URL != "" {
		u, err := url.Parse(sc.URL)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
			return sc, badInput("SANDGATE_SHARD_URL %q: want http(s)://host[:port], where the other shards reach this one", sc.URL)
		}
		sc.URL = strings.TrimSuffix(sc.URL, "/")
	} else if cloudRun {
		u, err := cloudRunURL(c.Context)
		if err != nil {
			// Alone it needs none; beside others, they cannot send it
			// requests for its sandboxes (they answer 503 for them).
			logger.Warn("the service's own URL could not be read from the metadata server: other shards sharing the store cannot forward requests here (set SANDGATE_SHARD_URL)", "err", err)
		}
		sc.URL = u
	}
	return sc, nil
}

// cloudRunURL is this Cloud Run service's own URL, in the deterministic
// form https://SERVICE-PROJECT_NUMBER.REGION.run.app, from the metadata
// server.
func cloudRunURL(ctx context.Context) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	num, err := metadata.NumericProjectIDWithContext(ctx)
	if err != nil {
		return "", fmt.Errorf("project number: %w", err)
	}
	region, err := metadata.GetWithContext(ctx, "instance/region") // projects/NUM/regions/REGION
	if err != nil {
		return "", fmt.Errorf("region: %w", err)
	}
	region = region[strings.LastIndex(region, "/")+1:]
	return fmt.Sprintf("https://%s-%s.%s.run.app", os.Getenv("K_SERVICE"), num, region), nil
}

// peerAuth gives a request forwarded to another shard on Cloud Run an
// identity token for that shard's URL (its IAM lets only invokers in;
// the shards' service account is one of each other's), in
// X-Serverless-Authorization, which Cloud Run's IAM reads before
// Authorization (where a bridge request carries the bridge's key).
// Elsewhere nothing: the shard's service token is credential enough.
func peerAuth(cloudRun bool, logger *slog.Logger) func(ctx context.Context, req *http.Request, peer string) error {
	if !cloudRun {
		return nil
	}
	var mu sync.Mutex
	sources := map[string]oauth2.TokenSource{}
	return func(ctx context.Context, req *http.Request, peer string) error {
		mu.Lock()
		ts := sources[peer]
		mu.Unlock()
		if ts == nil {
			s, err := idtoken.NewTokenSource(context.WithoutCancel(ctx), peer)
			if err != nil {
				return fmt.Errorf("identity tokens for %s: %w", peer, err)
			}
			ts = oauth2.ReuseTokenSource(nil, s)
			mu.Lock()
			sources[peer] = ts
			mu.Unlock()
		}
		tok, err := ts.Token()
		if err != nil {
			return fmt.Errorf("an identity token for %s: %w", peer, err)
		}
		req.Header.Set("X-Serverless-Authorization", "Bearer "+tok.AccessToken)
		return nil
	}
}
