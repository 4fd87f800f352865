# sandgate on Cloud Run: the same as deploy/README.md, as Terraform.

locals {
  digest = regex("@(sha256:[0-9a-f]{64})$", var.image)[0]
}

resource "google_project_service" "apis" {
  for_each           = toset(["run.googleapis.com", "secretmanager.googleapis.com", "storage.googleapis.com", "iam.googleapis.com"])
  service            = each.value
  disable_on_destroy = false
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

resource "google_cloud_run_v2_service" "sandgate" {
  name     = var.service_name
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
      # A running sandbox lives in its instance's memory: one instance until
      # sandgate shards.
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
  depends_on = [google_secret_manager_secret_iam_member.token, google_storage_bucket_iam_member.objects]
}

resource "google_cloud_run_v2_service_iam_member" "invokers" {
  for_each = toset(var.invokers)
  name     = google_cloud_run_v2_service.sandgate.name
  location = var.region
  role     = "roles/run.invoker"
  member   = each.value
}
