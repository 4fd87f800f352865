// Package e2e is sandgate's end-to-end suite: its tests drive a whole
// service through the bundled Go client (api/client), as a user's program
// does.
//
// With CLOUD_RUN_SANDBOX_URL set they run against that deployment (the
// identity token from gcloud, the service token from
// CLOUD_RUN_SANDBOX_SERVICE_TOKEN). Otherwise they start `sandgate serve`
// themselves on loopback, twice: over `sandgate sandbox` and over the
// stand-in for Google's Cloud Run sandbox CLI (internal/testkit/googlecli), each
// with a loopback DNS server, a package registry stand-in and an upstream
// that echoes credentials, so that nothing reaches the internet and CI runs
// them on every change. deploy/README.md says how to run them.
package e2e
