{{/* Names and labels shared by the templates. */}}
{{- define "disaggpool.fullname" -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "disaggpool.operatorName" -}}
{{- printf "%s-operator" (include "disaggpool.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "disaggpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "disaggpool.operatorName" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "disaggpool.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "disaggpool.labels" -}}
app.kubernetes.io/name: disaggpool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "disaggpool.selectorLabels" -}}
app.kubernetes.io/name: disaggpool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- /* The operator's cluster-only rules (manifests/02-rbac.yaml says why each is needed). */}}
{{- define "disaggpool.clusterRules" -}}
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [namespaces]
  verbs: [list, watch]
{{- end -}}

{{- /* The operator's namespaced rules (manifests/02-rbac.yaml says why each is needed). */}}
{{- define "disaggpool.namespacedRules" -}}
- apiGroups: [disaggpool.io]
  resources: [disaggpools]
  verbs: [get, list, watch, patch]
- apiGroups: [disaggpool.io]
  resources: [disaggpools/status]
  verbs: [get, patch]
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [endpoints]
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, list, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [batch]
  resources: [jobs]
  verbs: [get, list, watch, create, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, create, patch, delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, create, patch, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, create, patch, delete]
- apiGroups: [coordination.k8s.io]
  resources: [leases]
  verbs: [get, create, update]
{{- end -}}
