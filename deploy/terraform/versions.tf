terraform {
  required_version = ">= 1.5"
  required_providers {
    google = {
      source = "hashicorp/google"
      # sandbox_launcher on google_cloud_run_v2_service's containers came
      # with the provider change for Cloud Run sandboxes (magic-modules
      # #18396, 2026): use a release that has it. `terraform validate`
      # says "Unsupported argument" on an older one.
      version = ">= 7.0"
    }
  }
}

provider "google" {
  project = var.project
  region  = var.region
}
