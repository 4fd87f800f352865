# sandgate on Cloud Run: the same as deploy/README.md, as Terraform: one
# service, or var.shards services over one bucket.

locals {
  digest = regex("@(sha256:[0-9a-f]{64})$", var.image)[0]
  # Shard k's service. The first keeps service_name, so a deployment of one
  # service grows into shards without moving; the others are
  # service_name-1, service_name-2, ...
  shard_names = [for k in range(var.shards) : k == 0 ? var.service_name : "${var.service_name}-${k}"]
  # Each shard's deterministic URL: the SANDGATE_SHARD_URL it derives at
  # start, which its peers forward to and the Go client is given.
  shard_urls = [for name in local.shard_names : "https://${name}-${data.google_project.this.number}.${var.region}.run.app"]
  # roles/run.invoker on every shard for every caller: protocol 1's clients
  # may use any shard's URL, the Go client uses them all. Shard 0's keys are
  # the members alone, as before there were shards, so that adding shards
  # leaves its grants where they are.
  invoker_grants = merge([
    for k, name in local.shard_names : {
      for member in toset(var.invokers) : (k == 0 ? member : "${name} ${member}") => { service = name, member = member }
    }
  ]...)
}

data "google_project" "this" {}

resource "google_project_service" "apis" {
  for_each           = toset(["run.googleapis.com", "artifactregistry.googleapis.com", "secretmanager.googleapis.com", "storage.googleapis.com", "iam.googleapis.com"])
  service            = each.value
  disable_on_destroy = false
}

# The image's repository. Terraform makes it; the image is built and pushed
# into it between the two applies (README.md), since the service runs it by
# digest.
resource "google_artifact_registry_repository" "images" {
  location      = var.region
  repository_id = var.repository
  format        = "DOCKER"
  description   = "sandgate's image: the service, and every sandbox's read-only root"
  depends_on    = [google_project_service.apis]
}

# Snapshots and templates.
resource "google_storage_bucket" "store" {
  name                        = var.bucket_name
  location                    = var.region
  uniform_bucket_level_access = true
  public_access_prevention    = "enforced"
  # sandgate replaces and removes layers all the time; soft delete would keep
  # (and bill) every removed one.
  soft_delete_policy {
    retention_duration_seconds = 0
  }
  dynamic "lifecycle_rule" {
    for_each = var.template_max_age_days > 0 ? [1] : []
    content {
      condition {
        age            = var.template_max_age_days
        matches_prefix = ["templates/"]
      }
      action {
        type = "Delete"
      }
    }
  }
  depends_on = [google_project_service.apis]
}

# The service's identity: objects in that bucket, and the token's secret.
resource "google_service_account" "sandgate" {
  account_id   = "${var.service_name}-svc"
  display_name = "sandgate service"
  # The IAM API must be on before an account can be made in a new project.
  depends_on = [google_project_service.apis]
}

resource "google_storage_bucket_iam_member" "objects" {
  bucket = google_storage_bucket.store.name
  role   = "roles/storage.objectUser"
  member = "serviceAccount:${google_service_account.sandgate.email}"
}

resource "google_secret_manager_secret" "token" {
  secret_id = var.token_secret_id
  replication {
    auto {}
  }
  depends_on = [google_project_service.apis]
}

resource "google_secret_manager_secret_iam_member" "token" {
  secret_id = google_secret_manager_secret.token.id
  role      = "roles/secretmanager.secretAccessor"
  member    = "serviceAccount:${google_service_account.sandgate.email}"
}

# One service per shard, each one instance running its own sandboxes; all
# over the one bucket, whose leases say which shard runs which sandbox.
resource "google_cloud_run_v2_service" "sandgate" {
  count    = var.shards
  name     = local.shard_names[count.index]
  location = var.region
  # Cloud Run sandboxes are in Preview.
  launch_stage = "BETA"
  ingress      = "INGRESS_TRAFFIC_ALL"
  # No allUsers invoker below: only var.invokers reach it.
  deletion_protection = false

  template {
    service_account                  = google_service_account.sandgate.email
    execution_environment            = "EXECUTION_ENVIRONMENT_GEN2"
    timeout                          = "3600s"
    max_instance_request_concurrency = var.concurrency
    scaling {
      min_instance_count = var.min_instances
      # A service is one shard: its id and URL are the service's, so a
      # second instance would be a second shard under the same name. More
      # sandboxes: more shards (var.shards), never more instances.
      max_instance_count = 1
    }
    containers {
      image            = var.image
      sandbox_launcher = true
      resources {
        limits = {
          cpu    = var.cpu
          memory = var.memory
        }
        # CPU between requests too: commands run between requests, idle
        # suspend, the save on shutdown.
        cpu_idle = false
      }
      env {
        name  = "SNAPSHOT_BUCKET"
        value = google_storage_bucket.store.name
      }
      env {
        name  = "SANDBOX_IMAGE_ID"
        value = local.digest
      }
      # The shards a request, and this shard's credentials, may be
      # forwarded to: every shard's deterministic URL. A shard's URL in
      # the bucket is only the bucket's word; this list is the proof.
      env {
        name  = "SANDGATE_SHARD_PEERS"
        value = join(",", local.shard_urls)
      }
      env {
        name = "SANDBOX_SERVICE_TOKEN"
        value_source {
          secret_key_ref {
            secret  = google_secret_manager_secret.token.secret_id
            version = "latest"
          }
        }
      }
      dynamic "env" {
        for_each = var.env
        content {
          name  = env.key
          value = env.value
        }
      }
    }
  }
  lifecycle {
    precondition {
      condition     = length("${local.shard_names[count.index]}-${data.google_project.this.number}") <= 63
      error_message = "The service name ${local.shard_names[count.index]} is too long for a deterministic URL (https://NAME-PROJECT_NUMBER.REGION.run.app, whose first label is at most 63 characters): a shard announces that URL. Shorten service_name."
    }
  }
  depends_on = [google_secret_manager_secret_iam_member.token, google_storage_bucket_iam_member.objects]
}

# A configuration from before shards had the one service without count:
# it is shard 0, kept as it is.
moved {
  from = google_cloud_run_v2_service.sandgate
  to   = google_cloud_run_v2_service.sandgate[0]
}

resource "google_cloud_run_v2_service_iam_member" "invokers" {
  for_each   = local.invoker_grants
  name       = each.value.service
  location   = var.region
  role       = "roles/run.invoker"
  member     = each.value.member
  depends_on = [google_cloud_run_v2_service.sandgate]
}

# Between shards: a shard forwards a request for a sandbox another shard
# owns with an identity token for that shard's URL, so the shards' account
# is an invoker of every shard. None with one shard.
resource "google_cloud_run_v2_service_iam_member" "peers" {
  for_each   = var.shards > 1 ? toset(local.shard_names) : toset([])
  name       = each.value
  location   = var.region
  role       = "roles/run.invoker"
  member     = "serviceAccount:${google_service_account.sandgate.email}"
  depends_on = [google_cloud_run_v2_service.sandgate]
}
