from django.urls import path

from tests.integration.django.keys_project import views

urlpatterns = [
    path("orders/", views.orders),
    path("form/", views.form),
    path("upload/", views.upload),
    path("template/", views.template),
    path("simple-template/", views.simple_template),
    path("binary/<str:kind>/", views.binary),
    path("commits/", views.commits),
    path("shared/", views.shared),
    path("release/<str:tag>/", views.release),
    path("ready/", views.ready),
]
